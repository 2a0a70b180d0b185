#!/usr/bin/env bash
# openapi-generator's command-line jar, for the test that generates a client of the sidecar
# from its OpenAPI document (tests/integration/test_generated_client.py): copied once from
# Maven Central into ${CASQUE_CACHE:-~/.cache/casque}/openapi-generator/. Needs Java 17 and
# Maven (scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

version="7.25.0"
home="${CASQUE_CACHE:-$HOME/.cache/casque}/openapi-generator"
jar="$home/openapi-generator-cli-$version.jar"
if [ -s "$jar" ]; then
  exit 0
fi
mkdir -p "$home"
mvn -q -B dependency:copy -Dartifact="org.openapitools:openapi-generator-cli:$version" -DoutputDirectory="$home.part"
mv "$home.part/openapi-generator-cli-$version.jar" "$jar"
rm -rf "$home.part"
echo "install-openapi-generator: $jar"
