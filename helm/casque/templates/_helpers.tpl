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
{{- else if .Values.zookeeper.auth.username -}}
{{- printf "%s-zookeeper" (include "casque.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The client ports of zookeeper.connect (host:port[,host:port...][/chroot]), as a JSON list. */}}
{{- define "casque.zookeeperPorts" -}}
{{- $ports := list }}
{{- range splitList "," (first (splitList "/" .Values.zookeeper.connect)) }}
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
{{- else if .Values.cassandra.auth.username -}}
{{- printf "%s-cassandra" (include "casque.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the derivation key the namespaces' passwords come from: with Cassandra
     keyspace isolation or ZooKeeper authentication only. */}}
{{- define "casque.derivationKeySecret" -}}
{{- if or (eq .Values.cassandra.isolation "keyspace") (include "casque.zookeeperSecret" .) -}}
{{- default (printf "%s-derivation-key" (include "casque.fullname" .)) .Values.derivationKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart makes the derivation key's Secret itself. */}}
{{- define "casque.generatesDerivationKey" -}}
{{- if and (include "casque.derivationKeySecret" .) (not .Values.derivationKey.existingSecret) }}true{{ end }}
{{- end -}}

{{/* The chart's derivation key, base64: the existing Secret's, so an upgrade keeps it, else
     48 random characters (crypto/rand), made once per render and remembered in .Values so
     that the Secret and the operator's checksum annotation name the same key. */}}
{{- define "casque.derivationKeyData" -}}
{{- $memo := .Values.derivationKey -}}
{{- if not (hasKey $memo "_rendered") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "casque.derivationKeySecret" .) -}}
{{- $data := "" -}}
{{- if $existing -}}
{{- $data = index ($existing.data | default dict) $memo.key | default "" -}}
{{- end -}}
{{- $_ := set $memo "_rendered" ($data | default (randAlphaNum 48 | b64enc)) -}}
{{- end -}}
{{- get $memo "_rendered" -}}
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
{{- if or (include "casque.zookeeperSecret" .) (eq .Values.cassandra.isolation "keyspace") (include "casque.copiedSecrets" .) }}true{{ end }}
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
{{- if and .Values.sidecar.credentialsSecret (ne .Values.cassandra.isolation "keyspace") -}}
{{- $names = append $names .Values.sidecar.credentialsSecret -}}
{{- end -}}
{{- range $backend := list "cassandra" "zookeeper" -}}
{{- $tls := (index $.Values $backend).tls -}}
{{- if and $tls.enabled $tls.secret -}}
{{- $names = append $names $tls.secret -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $names | uniq | join ", " -}}
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
