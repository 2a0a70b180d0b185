{{/* Names, labels and images shared by the templates. */}}

{{- define "casque.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "casque.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "casque.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "casque.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "casque.selectorLabels" -}}
app.kubernetes.io/name: {{ include "casque.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "casque.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "casque.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference from {repository, tag, digest}: registry/repository@digest or :tag. */}}
{{- define "casque.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $repository := $image.repository -}}
{{- if $root.Values.image.registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" $root.Values.image.registry) $image.repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "casque.leaseName" -}}
{{- default (include "casque.fullname" .) .Values.operator.leaderElection.leaseName -}}
{{- end -}}

{{/* The Secret holding the operator's ZooKeeper identity, if any. */}}
{{- define "casque.zookeeperSecret" -}}
{{- if .Values.zookeeper.auth.existingSecret -}}
{{- .Values.zookeeper.auth.existingSecret -}}
{{- else if or .Values.zookeeper.auth.username (include "casque.generatesZookeeperIdentity" .) -}}
{{- printf "%s-zookeeper" (include "casque.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart makes the installation's ZooKeeper identity itself: for the embedded
     ensemble with backends.zookeeper.auth, when zookeeper.auth names none. */}}
{{- define "casque.generatesZookeeperIdentity" -}}
{{- $auth := .Values.zookeeper.auth -}}
{{- if and .Values.backends.embedded .Values.backends.zookeeper.auth (not $auth.username) (not $auth.existingSecret) }}true{{ end }}
{{- end -}}

{{/* Whether the embedded Cassandra checks logins: the operator's pods then make the
     installation's login its superuser before they start (casque secure-cassandra). */}}
{{- define "casque.embeddedCassandraAuth" -}}
{{- if and .Values.backends.embedded (eq .Values.backends.cassandra.authenticator "PasswordAuthenticator") }}true{{ end }}
{{- end -}}

{{/* Whether the chart makes the installation's Cassandra login itself: for the embedded
     Cassandra with PasswordAuthenticator, when cassandra.auth names none. */}}
{{- define "casque.generatesCassandraLogin" -}}
{{- $auth := .Values.cassandra.auth -}}
{{- if and (include "casque.embeddedCassandraAuth" .) (not $auth.username) (not $auth.existingSecret) }}true{{ end }}
{{- end -}}

{{/* cassandra.isolation with `auto` resolved: keyspace isolation where the chart holds the
     embedded Cassandra's login, none elsewhere (external clusters keep their behaviour). */}}
{{- define "casque.isolation" -}}
{{- if eq .Values.cassandra.isolation "auto" -}}
{{- ternary "keyspace" "none" (eq (include "casque.embeddedCassandraAuth" .) "true") -}}
{{- else -}}
{{- .Values.cassandra.isolation -}}
{{- end -}}
{{- end -}}

{{/* A random value the chart generates once and keeps: (list . "<secret name>" "<key>"). The
     existing Secret's value, so that an upgrade keeps it (lookup; `helm template` has no
     cluster and makes a new one), else 48 random characters (crypto/rand); base64. Made once
     per render and remembered in .Values, so that the Secret and the operator's checksum
     annotation name the same value. */}}
{{- define "casque.keptRandom" -}}
{{- $root := index . 0 -}}
{{- $secret := index . 1 -}}
{{- $key := index . 2 -}}
{{- if not (hasKey $root.Values "_kept") -}}
{{- $_ := set $root.Values "_kept" dict -}}
{{- end -}}
{{- $memo := get $root.Values "_kept" -}}
{{- $slot := printf "%s/%s" $secret $key -}}
{{- if not (hasKey $memo $slot) -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace $secret -}}
{{- $data := "" -}}
{{- if $existing -}}
{{- $data = index ($existing.data | default dict) $key | default "" -}}
{{- end -}}
{{- $_ := set $memo $slot ($data | default (randAlphaNum 48 | b64enc)) -}}
{{- end -}}
{{- get $memo $slot -}}
{{- end -}}

{{/* The client ports of the ZooKeeper connect string (host:port[,host:port...][/chroot]), as a JSON list. */}}
{{- define "casque.zookeeperPorts" -}}
{{- $ports := list }}
{{- range splitList "," (first (splitList "/" (include "casque.zookeeperConnect" .))) | compact }}
{{- $parts := splitList ":" (trim .) }}
{{- $port := ternary (last $parts) "2181" (gt (len $parts) 1) | int }}
{{- $ports = append $ports $port }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/* The Secret holding the Cassandra username and password, if any. */}}
{{- define "casque.cassandraSecret" -}}
{{- if .Values.cassandra.auth.existingSecret -}}
{{- .Values.cassandra.auth.existingSecret -}}
{{- else if or .Values.cassandra.auth.username (include "casque.generatesCassandraLogin" .) -}}
{{- printf "%s-cassandra" (include "casque.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the derivation key the namespaces' passwords come from: with Cassandra
     keyspace isolation or ZooKeeper authentication only. */}}
{{- define "casque.derivationKeySecret" -}}
{{- if or (eq (include "casque.isolation" .) "keyspace") (include "casque.zookeeperSecret" .) -}}
{{- default (printf "%s-derivation-key" (include "casque.fullname" .)) .Values.derivationKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart makes the derivation key's Secret itself. */}}
{{- define "casque.generatesDerivationKey" -}}
{{- if and (include "casque.derivationKeySecret" .) (not .Values.derivationKey.existingSecret) }}true{{ end }}
{{- end -}}

{{/* The chart's derivation key, base64 (casque.keptRandom). */}}
{{- define "casque.derivationKeyData" -}}
{{- include "casque.keptRandom" (list . (include "casque.derivationKeySecret" .) .Values.derivationKey.key) -}}
{{- end -}}

{{- define "casque.webhookService" -}}
{{- printf "%s-webhook" (include "casque.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "casque.webhookSecret" -}}
{{- if eq .Values.injection.tls.mode "secret" -}}
{{- .Values.injection.tls.existingSecret -}}
{{- else -}}
{{- printf "%s-webhook-tls" (include "casque.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The rights on casque's resources, cluster-wide or in each watched namespace. */}}
{{- define "casque.resourceRules" -}}
- apiGroups: [casque.io]
  resources: [queues, subscribers]
  verbs: [get, list, watch, patch, update]
- apiGroups: [casque.io]
  resources: [queues/status, subscribers/status]
  verbs: [get, patch, update]
- apiGroups: [casque.io]
  resources: [queues/finalizers, subscribers/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- if include "casque.writesSecrets" . }}
# Each namespace's ZooKeeper identity and Cassandra role, written with its first Queue,
# deleted after its last, and the copies of the sidecar's Secrets: those Secrets by name, no
# other, and no list or watch. A create cannot be limited to names in RBAC: the chart's
# ValidatingAdmissionPolicy (rbac.yaml) refuses the operator's create of any other Secret.
- apiGroups: [""]
  resources: [secrets]
  resourceNames: [{{ include "casque.namespaceSecrets" . }}]
  verbs: [get, patch, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- end }}
{{- end -}}

{{/* Non-empty when the operator writes Secrets into the namespaces it serves. */}}
{{- define "casque.writesSecrets" -}}
{{- if or (include "casque.zookeeperSecret" .) (eq (include "casque.isolation" .) "keyspace") (include "casque.copiedSecrets" .) }}true{{ end }}
{{- end -}}

{{/* The names of the Secrets the operator writes in a namespace: each namespace's identities
     (operator/tenancy.py) and the copies of the sidecar's Secrets (operator/copies.py). */}}
{{- define "casque.namespaceSecrets" -}}
{{- concat (list "casque-zookeeper" "casque-cassandra-role") (splitList ", " (include "casque.copiedSecrets" .) | compact) | uniq | join ", " -}}
{{- end -}}

{{/* The Secrets injected sidecars read by name in their own namespace, which the operator
     copies there from the release's namespace (operator/copies.py), ", "-separated. */}}
{{- define "casque.copiedSecrets" -}}
{{- $names := list -}}
{{- if .Values.injection.enabled -}}
{{- if and .Values.sidecar.credentialsSecret (ne (include "casque.isolation" .) "keyspace") -}}
{{- $names = append $names .Values.sidecar.credentialsSecret -}}
{{- end -}}
{{- range $backend := list "cassandra" "zookeeper" -}}
{{- $tls := include "casque.clientTls" (list $ $backend) | fromJson -}}
{{- if and $tls.enabled $tls.secret -}}
{{- $names = append $names $tls.secret -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $names | uniq | join ", " -}}
{{- end -}}

{{/* Whether the release's own backends speak TLS to their clients (backends.tls). */}}
{{- define "casque.embeddedTls" -}}
{{- if and .Values.backends.embedded .Values.backends.tls.enabled }}true{{ end -}}
{{- end -}}

{{/* Whether cert-manager issues the embedded backends' certificates: when it issues the
     webhook's (injection.tls.mode certManager), so that `helm template` renders nothing random. */}}
{{- define "casque.backendCertificatesByCertManager" -}}
{{- if and (include "casque.embeddedTls" .) .Values.injection.enabled (eq .Values.injection.tls.mode "certManager") }}true{{ end -}}
{{- end -}}

{{/* TLS to one backend as the operator and the sidecars use it, as JSON: (list . "cassandra"|"zookeeper").
     The values' cassandra.tls or zookeeper.tls; with the embedded backends' TLS, the CA in
     the backend's certificate Secret (<name>-<backend>-tls, whose copies in the sidecars'
     namespaces hold ca.crt alone: operator/copies.py) and the name the certificate carries,
     the client Service's. */}}
{{- define "casque.clientTls" -}}
{{- $root := index . 0 -}}
{{- $backend := index . 1 -}}
{{- if include "casque.embeddedTls" $root -}}
{{- $service := include "casque.serviceHost" (list $root (include "casque.backendName" (list $root $backend))) -}}
{{- dict "enabled" true "secret" (include "casque.backendName" (list $root (printf "%s-tls" $backend))) "clientCertificate" false "verifyHostname" true "serverHostname" (ternary $service "" (eq $backend "cassandra")) | toJson -}}
{{- else -}}
{{- (index $root.Values $backend).tls | toJson -}}
{{- end -}}
{{- end -}}

{{/*
The embedded backends' certificates, as JSON: {"ca": {crt, key}, "cassandra": {crt, key,
names, renewAfter}, "zookeeper": {...}}, PEM. Made once per rendering (the StatefulSets carry
a digest of what the Secrets hold, so every template must see the same) and kept across
upgrades: the CA as long as its Secret exists; a backend's certificate until the first upgrade
after half its life, or until the CA or the names it must carry change. Without a cluster to
look in (`helm template`) everything is made anew. RSA keys: genCA and genSignedCert make no
other kind.
*/}}
{{- define "casque.backendCertificates" -}}
{{- $tls := .Values.backends.tls -}}
{{- if not (hasKey $tls "_made") -}}
{{- $namespace := .Release.Namespace -}}
{{- $now := now | unixEpoch | int64 -}}
{{- $kept := lookup "v1" "Secret" $namespace (include "casque.backendName" (list . "tls-ca-key")) -}}
{{- $ca := dict -}}
{{- if and $kept (index ($kept.data | default dict) "tls.crt") (index ($kept.data | default dict) "tls.key") -}}
{{- $ca = buildCustomCert (index $kept.data "tls.crt") (index $kept.data "tls.key") -}}
{{- else -}}
{{- $ca = genCA (printf "%s backends CA" (include "casque.fullname" .)) (int $tls.caDays) -}}
{{- end -}}
{{- $made := dict "ca" (dict "crt" $ca.Cert "key" $ca.Key) -}}
{{- range $backend := list "cassandra" "zookeeper" -}}
{{- $service := include "casque.serviceHost" (list $ (include "casque.backendName" (list $ $backend))) -}}
{{- $peers := include "casque.serviceHost" (list $ (include "casque.backendName" (list $ (printf "%s-peers" $backend)))) -}}
{{- $names := list $service (printf "*.%s" $peers) -}}
{{- $existing := lookup "v1" "Secret" $namespace (include "casque.backendName" (list $ (printf "%s-tls" $backend))) -}}
{{- $data := $existing.data | default dict -}}
{{- $annotations := dig "metadata" "annotations" dict $existing -}}
{{- $renewAfter := index $annotations "casque.io/renew-after" | default "0" | int64 -}}
{{- if and $existing (eq (index $data "ca.crt" | default "") ($ca.Cert | b64enc)) (eq (index $annotations "casque.io/names" | default "") (join "," $names)) (lt $now $renewAfter) -}}
{{- $_ := set $made $backend (dict "crt" (index $data "tls.crt" | b64dec) "key" (index $data "tls.key" | b64dec) "names" (join "," $names) "renewAfter" (toString $renewAfter)) -}}
{{- else -}}
{{- $certificate := genSignedCert (include "casque.backendName" (list $ $backend)) nil $names (int $tls.certificateDays) $ca -}}
{{- $_ := set $made $backend (dict "crt" $certificate.Cert "key" $certificate.Key "names" (join "," $names) "renewAfter" (toString (add $now (mul (div (int $tls.certificateDays) 2) 86400)))) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $tls "_made" $made -}}
{{- end -}}
{{- toJson $tls._made -}}
{{- end -}}

{{/* A backend's TLS in its StatefulSet, with backends.tls (empty without): the container's
     variable naming the certificate's directory (list . "cassandra" "CASSANDRA_TLS_DIR"),
     its mount and its volume (list . "cassandra"), and the pod template's annotation that
     rolls the pods to a new certificate (none when cert-manager renews it: the pods read it
     at their next start, deploy.md "TLS"). */}}
{{- define "casque.backendTlsEnv" -}}
{{- if include "casque.embeddedTls" (index . 0) }}
- name: {{ index . 2 }}
  value: /etc/casque-tls
{{- end -}}
{{- end -}}

{{/* Whether a backend's pods talk to each other over TLS (list . "cassandra"
     "CASSANDRA_INTERNODE_TLS"): backends.tls.internode when true or false; null: on for a new
     release, and for an existing one as its StatefulSet runs now (the variable set to "true"
     in its pod template), since a ring or an ensemble whose pods disagree cannot talk. */}}
{{- define "casque.backendPeerTls" -}}
{{- $root := index . 0 -}}
{{- $variable := index . 2 -}}
{{- if include "casque.embeddedTls" $root -}}
{{- $wanted := $root.Values.backends.tls.internode -}}
{{- if kindIs "invalid" $wanted -}}
{{- $running := lookup "apps/v1" "StatefulSet" $root.Release.Namespace (include "casque.backendName" (list $root (index . 1))) -}}
{{- if $running -}}
{{- range $container := $running.spec.template.spec.containers -}}
{{- range $env := $container.env | default list -}}
{{- if and (eq $env.name $variable) (eq (toString $env.value) "true") }}true{{ end -}}
{{- end -}}
{{- end -}}
{{- else -}}
true
{{- end -}}
{{- else if $wanted -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "casque.backendPeerTlsEnv" -}}
{{- if include "casque.backendPeerTls" . }}
- name: {{ index . 2 }}
  value: "true"
{{- end -}}
{{- end -}}

{{- define "casque.backendTlsMount" -}}
{{- if include "casque.embeddedTls" (index . 0) }}
- {name: tls, mountPath: /etc/casque-tls, readOnly: true}
{{- end -}}
{{- end -}}

{{- define "casque.backendTlsVolume" -}}
{{- $root := index . 0 -}}
{{- if include "casque.embeddedTls" $root }}
- name: tls
  secret:
    secretName: {{ include "casque.backendName" (list $root (printf "%s-tls" (index . 1))) }}
    defaultMode: 0440
{{- end -}}
{{- end -}}

{{- define "casque.backendTlsAnnotation" -}}
{{- $root := index . 0 -}}
{{- if and (include "casque.embeddedTls" $root) (not (include "casque.backendCertificatesByCertManager" $root)) }}
casque.io/tls-certificate: {{ (index (include "casque.backendCertificates" $root | fromJson) (index . 1)).crt | sha256sum | trunc 16 | quote }}
{{- end -}}
{{- end -}}

{{/*
The operator's TLS settings for one backend: (list "cassandra"|"zookeeper" .Values.<backend>.tls).
The files are the backend's Secret mounted at /etc/casque/tls/<backend> (operator/injection.py
mounts the namespace's copy at the same place in sidecars).
*/}}
{{- define "casque.tlsEnv" -}}
{{- $backend := index . 0 }}
{{- $tls := index . 1 }}
{{- $prefix := printf "CASQUE_%s_TLS_" (upper $backend) }}
- name: {{ $prefix }}ENABLED
  value: "true"
- name: {{ $prefix }}VERIFY_HOSTNAME
  value: {{ $tls.verifyHostname | quote }}
{{- if $tls.secret }}
- name: {{ $prefix }}CA_FILE
  value: /etc/casque/tls/{{ $backend }}/ca.crt
{{- end }}
{{- if $tls.clientCertificate }}
- name: {{ $prefix }}CERT_FILE
  value: /etc/casque/tls/{{ $backend }}/tls.crt
- name: {{ $prefix }}KEY_FILE
  value: /etc/casque/tls/{{ $backend }}/tls.key
{{- end }}
{{- with $tls.serverHostname }}
- name: {{ $prefix }}SERVER_HOSTNAME
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Refuse a cluster older than 1.29, whose API server would drop the sidecar's restartPolicy
Always and leave every injected pod waiting on an init container that never ends. Only a
real cluster is checked: without one (`helm template`, `helm lint`) lookup finds nothing and
.Capabilities holds helm's own default version, which says nothing of the target cluster.
*/}}
{{- define "casque.requireKubernetes" -}}
{{- if lookup "v1" "Namespace" "" "kube-system" -}}
{{- if semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version -}}
{{- fail (printf "casque needs Kubernetes 1.29 or later (native sidecar containers); this cluster runs %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The backends' addresses. With backends.embedded the release runs Cassandra and ZooKeeper
itself (zookeeper.yaml, cassandra.yaml) and every reader of the addresses, the operator's
environment and through it each injected sidecar's, gets those Services' names; otherwise the
values of cassandra.* and zookeeper.*. Sidecars run in other namespaces, so the names are
fully qualified.
*/}}

{{/* A name for one of the embedded backends' objects: (list . "zookeeper-peers"). The full
     name is cut to 40 characters so that "-cassandra-peers" and the StatefulSet's pod and
     revision names stay within 63. */}}
{{- define "casque.backendName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "casque.fullname" $root | trunc 40 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{/* A Service's DNS name from anywhere in the cluster: (list . "<name>"). */}}
{{- define "casque.serviceHost" -}}
{{- $root := index . 0 -}}
{{- printf "%s.%s.svc.%s" (index . 1) $root.Release.Namespace $root.Values.backends.clusterDomain -}}
{{- end -}}

{{- define "casque.zookeeperConnect" -}}
{{- if .Values.backends.embedded -}}
{{- printf "%s:%d" (include "casque.serviceHost" (list . (include "casque.backendName" (list . "zookeeper")))) (ternary 2281 2181 (eq (include "casque.embeddedTls" .) "true")) -}}
{{- else -}}
{{- .Values.zookeeper.connect -}}
{{- end -}}
{{- end -}}

{{/* Comma-separated, as CASQUE_CASSANDRA_CONTACT_POINTS takes them. The embedded client
     Service is headless: its name resolves to every ready node, and the driver tries each. */}}
{{- define "casque.cassandraContactPoints" -}}
{{- if .Values.backends.embedded -}}
{{- include "casque.serviceHost" (list . (include "casque.backendName" (list . "cassandra"))) -}}
{{- else -}}
{{- join "," .Values.cassandra.contactPoints -}}
{{- end -}}
{{- end -}}

{{- define "casque.cassandraPort" -}}
{{- if .Values.backends.embedded }}9042{{ else }}{{ .Values.cassandra.port }}{{ end -}}
{{- end -}}

{{- define "casque.cassandraLocalDatacenter" -}}
{{- if .Values.backends.embedded -}}
{{- .Values.backends.cassandra.datacenter -}}
{{- else -}}
{{- .Values.cassandra.localDatacenter -}}
{{- end -}}
{{- end -}}

{{/* The keyspace's replication as JSON: {"strategy": ..., "factor": n} or {"strategy": ...,
     "datacenters": {dc: n}}. The embedded ring is one datacenter of 1 or 3 nodes: as many
     replicas as nodes, at most 3. */}}
{{- define "casque.replication" -}}
{{- if .Values.backends.embedded -}}
{{- $cassandra := .Values.backends.cassandra -}}
{{- dict "strategy" "NetworkTopologyStrategy" "datacenters" (dict $cassandra.datacenter (min 3 (int $cassandra.replicas))) | toJson -}}
{{- else -}}
{{- $replication := .Values.cassandra.replication -}}
{{- if eq $replication.strategy "SimpleStrategy" -}}
{{- dict "strategy" $replication.strategy "factor" $replication.factor | toJson -}}
{{- else -}}
{{- dict "strategy" $replication.strategy "datacenters" $replication.datacenters | toJson -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where Cassandra is and the operator's login to it: the operator's environment, and its
     init container's (secure-cassandra). */}}
{{- define "casque.cassandraLoginEnv" -}}
{{- $secret := include "casque.cassandraSecret" . -}}
- name: CASQUE_CASSANDRA_CONTACT_POINTS
  value: {{ include "casque.cassandraContactPoints" . | quote }}
- name: CASQUE_CASSANDRA_PORT
  value: {{ include "casque.cassandraPort" . | quote }}
{{- with include "casque.cassandraLocalDatacenter" . }}
- name: CASQUE_CASSANDRA_LOCAL_DC
  value: {{ . | quote }}
{{- end }}
{{- if $secret }}
- name: CASQUE_CASSANDRA_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.cassandra.auth.usernameKey }}
- name: CASQUE_CASSANDRA_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.cassandra.auth.passwordKey }}
{{- end }}
{{- end -}}

{{/* The keyspace's replication as CASQUE_REPLICATION_* (secure-cassandra gives system_auth the same). */}}
{{- define "casque.replicationEnv" -}}
{{- $replication := include "casque.replication" . | fromJson -}}
- name: CASQUE_REPLICATION_STRATEGY
  value: {{ $replication.strategy | quote }}
{{- if eq $replication.strategy "SimpleStrategy" }}
- name: CASQUE_REPLICATION_FACTOR
  value: {{ $replication.factor | quote }}
{{- else }}
- name: CASQUE_REPLICATION_DATACENTERS
  value: {{ toJson $replication.datacenters | quote }}
{{- end }}
{{- end -}}

{{/*
Refuse backend settings that cannot work together, in one sentence.

With backends.embedded, the release's own Cassandra and ZooKeeper replace the external ones,
and they speak TLS with certificates of the chart's own (backends.tls), without SASL. Values cannot tell a value the user set from the
chart's default once Helm has merged them, and the external defaults (contactPoints
[cassandra], connect zookeeper:2181, port 9042) must stay as they are for every install made
without the embedded backends. So an address counts as set when it differs from that default
(or from empty, which says "none"): leaving it, or setting it to the default, is harmless,
because the embedded Services win. tests/integration/test_helm.py fails if values.yaml's
defaults move away from the ones named here.
*/}}
{{- define "casque.checkBackends" -}}
{{- $cassandra := .Values.cassandra -}}
{{- $zookeeper := .Values.zookeeper -}}
{{- if .Values.backends.embedded -}}
{{- $conflicts := list -}}
{{- if and $cassandra.contactPoints (ne (toJson $cassandra.contactPoints) (toJson (list "cassandra"))) -}}
{{- $conflicts = append $conflicts "cassandra.contactPoints" -}}
{{- end -}}
{{- if ne (int $cassandra.port) 9042 -}}
{{- $conflicts = append $conflicts "cassandra.port" -}}
{{- end -}}
{{- if and $cassandra.localDatacenter (ne $cassandra.localDatacenter .Values.backends.cassandra.datacenter) -}}
{{- $conflicts = append $conflicts "cassandra.localDatacenter" -}}
{{- end -}}
{{- if and $zookeeper.connect (ne $zookeeper.connect "zookeeper:2181") -}}
{{- $conflicts = append $conflicts "zookeeper.connect" -}}
{{- end -}}
{{- if $cassandra.tls.enabled -}}
{{- $conflicts = append $conflicts "cassandra.tls" -}}
{{- end -}}
{{- if $zookeeper.tls.enabled -}}
{{- $conflicts = append $conflicts "zookeeper.tls" -}}
{{- end -}}
{{- if $zookeeper.auth.sasl -}}
{{- $conflicts = append $conflicts "zookeeper.auth.sasl" -}}
{{- end -}}
{{- with $conflicts -}}
{{- fail (printf "backends.embedded=true runs Cassandra and ZooKeeper in the release, with TLS of its own (backends.tls) and without SASL, so %s must be left unset (or set backends.embedded=false to use your own clusters)" (join ", " .)) -}}
{{- end -}}
{{- $isolation := include "casque.isolation" . -}}
{{- if include "casque.embeddedCassandraAuth" . -}}
{{- if eq $cassandra.auth.username "cassandra" -}}
{{- fail "cassandra.auth.username cannot be cassandra with backends.embedded=true: that is Cassandra's default superuser, which the operator's pods disable; name the installation's login otherwise, or leave it empty for the chart's" -}}
{{- end -}}
{{- if and (eq $isolation "none") .Values.injection.enabled (not .Values.sidecar.credentialsSecret) -}}
{{- fail "cassandra.isolation=none with the embedded Cassandra's PasswordAuthenticator leaves sidecars without a login: set cassandra.isolation=keyspace (or auto), or sidecar.credentialsSecret to a Secret with a role you made" -}}
{{- end -}}
{{- else if eq $isolation "keyspace" -}}
{{- fail "cassandra.isolation=keyspace needs logins: backends.cassandra.authenticator=AllowAllAuthenticator has none (use PasswordAuthenticator, or cassandra.isolation=none)" -}}
{{- end -}}
{{- if not (dig "limits" "memory" "" (.Values.backends.cassandra.resources | default dict)) -}}
{{- fail "backends.cassandra.resources.limits.memory is needed with backends.embedded=true: Cassandra's heap is half of it" -}}
{{- end -}}
{{- else -}}
{{- if not $cassandra.contactPoints -}}
{{- fail "cassandra.contactPoints is empty: name your Cassandra nodes there, or set backends.embedded=true to run Cassandra in the release" -}}
{{- end -}}
{{- if not $zookeeper.connect -}}
{{- fail "zookeeper.connect is empty: give your ZooKeeper ensemble's host:port list there, or set backends.embedded=true to run ZooKeeper in the release" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A memory quantity (2Gi, 1500M, 2147483648) in whole MiB. */}}
{{- define "casque.mebibytes" -}}
{{- $quantity := toString . -}}
{{- $number := regexFind "^[0-9.]+" $quantity -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $unit := get $units (trimPrefix $number $quantity) | default 1 -}}
{{- divf (mulf $number $unit) 1048576 | floor | int -}}
{{- end -}}

{{/* Whether a set of NetworkPolicies is made: (list . "operator"|"backends"). Their `enabled`
     null (the default) follows backends.embedded. "true" or empty. */}}
{{- define "casque.networkPolicyOn" -}}
{{- $root := index . 0 -}}
{{- $np := $root.Values.networkPolicy -}}
{{- $enabled := ternary $np.enabled $np.backends.enabled (eq (index . 1) "operator") -}}
{{- if kindIs "invalid" $enabled }}{{ $enabled = $root.Values.backends.embedded }}{{ end -}}
{{- if $enabled }}true{{ end -}}
{{- end -}}

{{/* The embedded backends' labels: (list . "zookeeper"|"cassandra"). Named for the backend,
     so that networkPolicy.backends' default pod selectors find them. */}}
{{- define "casque.backendSelectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ index . 1 }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- end -}}

{{- define "casque.backendLabels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
{{ include "casque.backendSelectorLabels" . }}
app.kubernetes.io/part-of: {{ include "casque.name" $root }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end -}}

{{/* What both embedded backends' pods share: (list . "zookeeper"|"cassandra"). No API token,
     no Service variables, a non-root user that owns its volumes, and members on different
     nodes where the scheduler can. */}}
{{- define "casque.backendPodSpec" -}}
{{- $root := index . 0 -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with $root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "casque.backendSelectorLabels" . | nindent 14 }}
{{- end -}}

{{- define "casque.backendContainerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The data volume of each member: (list . .Values.backends.<backend>). A null class leaves
     storageClassName out (the cluster's default class); "" asks for no class at all (a
     pre-made PersistentVolume, no dynamic provisioning). */}}
{{- define "casque.backendVolumeClaim" -}}
{{- $storage := (index . 1).storage -}}
- metadata:
    name: data
  spec:
    accessModes: [ReadWriteOnce]
    {{- if not (kindIs "invalid" $storage.storageClassName) }}
    storageClassName: {{ $storage.storageClassName | quote }}
    {{- end }}
    resources:
      requests:
        storage: {{ $storage.size | quote }}
{{- end -}}

{{/* maxUnavailable 1: a node drain takes one member at a time. A member that is not ready
may only be slow (its probe timed out on a busy node) and still vote in the quorum, so it is
evicted only while the others are all healthy (IfHealthyBudget): a drain never takes the
ensemble or the ring below a quorum, and one member down alone never holds a drain up. */}}
{{- define "casque.backendDisruptionBudget" -}}
{{- $root := index . 0 -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "casque.backendName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "casque.backendLabels" . | nindent 4 }}
spec:
  maxUnavailable: 1
  unhealthyPodEvictionPolicy: IfHealthyBudget
  selector:
    matchLabels:
      {{- include "casque.backendSelectorLabels" . | nindent 6 }}
{{- end -}}
