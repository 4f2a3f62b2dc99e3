{{/*
The Secrets this chart renders, as JSON: {"admin"|"node"|"tls"|"mqtt": {"name": N, "data": {key:
base64}}} ("mqttPublisher": the kvfence account's key of "mqtt" alone, which is all that kvfence's
pods mount). An entry is absent where the Secret is the user's (existingSecret) or not needed (TLS
off; MQTT without a broker or with mqtt.auth.enabled false).

secrets.yaml renders these, and every Deployment that mounts one hashes its data into the pod
template (checksum/secrets): the control plane reads both tokens, and every service its TLS files,
once at start (nodes too: each keeps the node token it started with, both ways; kvfence.node),
so without the hash a rotated Secret would restart nothing and the pods would keep the old value.

Resolved once per render and kept in .Values (every template of the chart shares that map): a
generated token is a randAlphaNum draw, and the Secret and the checksums must see the same draw.
*/}}
{{- define "kvfence.renderedSecrets" -}}
{{- if not (hasKey .Values "__kvfenceRenderedSecrets") }}
{{- $out := dict }}
{{- if not .Values.adminToken.existingSecret }}
{{- $name := include "kvfence.adminSecretName" . }}
{{- $token := include "kvfence.token" (dict "root" . "name" $name "key" .Values.adminToken.key "value" .Values.adminToken.value) }}
{{- $_ := set $out "admin" (dict "name" $name "data" (dict .Values.adminToken.key ($token | b64enc))) }}
{{- end }}
{{- if not .Values.nodeToken.existingSecret }}
{{- /* Kept across upgrades like the admin token: running nodes must keep registering. */}}
{{- $name := include "kvfence.nodeSecretName" . }}
{{- $token := include "kvfence.token" (dict "root" . "name" $name "key" .Values.nodeToken.key "value" .Values.nodeToken.value) }}
{{- $_ := set $out "node" (dict "name" $name "data" (dict .Values.nodeToken.key ($token | b64enc))) }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- $t := .Values.tls }}
{{- if not (and $t.publicCert $t.publicKey $t.internalCa $t.internalCert $t.internalKey) }}
{{- fail "tls.enabled: give tls.existingSecret, or all of tls.publicCert, publicKey, internalCa, internalCert and internalKey" }}
{{- end }}
{{- $data := dict "public.crt" ($t.publicCert | b64enc) "public.key" ($t.publicKey | b64enc) "ca.crt" ($t.internalCa | b64enc) "internal.crt" ($t.internalCert | b64enc) "internal.key" ($t.internalKey | b64enc) }}
{{- $_ := set $out "tls" (dict "name" (include "kvfence.tlsSecretName" .) "data" $data) }}
{{- end }}
{{- if and (include "kvfence.mqttAuth" .) (not .Values.mqtt.auth.existingSecret) }}
{{- /* Kept across upgrades too: the broker and kvfence's pods must keep agreeing. */}}
{{- $a := .Values.mqtt.auth }}
{{- $name := include "kvfence.mqttSecretName" . }}
{{- $password := include "kvfence.token" (dict "root" . "name" $name "key" $a.passwordKey "value" $a.password) }}
{{- $data := dict $a.passwordKey ($password | b64enc) }}
{{- if include "kvfence.mqttReader" . }}
{{- $reader := include "kvfence.token" (dict "root" . "name" $name "key" $a.readerPasswordKey "value" $a.readerPassword) }}
{{- $_ := set $data $a.readerPasswordKey ($reader | b64enc) }}
{{- end }}
{{- $_ := set $out "mqtt" (dict "name" $name "data" $data) }}
{{- /* Not a Secret of its own: the part of the one above that kvfence's pods mount, for their
       checksum (a new reader password restarts the broker only). */}}
{{- $_ := set $out "mqttPublisher" (dict "name" $name "data" (pick $data $a.passwordKey)) }}
{{- end }}
{{- $_ := set .Values "__kvfenceRenderedSecrets" $out }}
{{- end }}
{{- index .Values "__kvfenceRenderedSecrets" | toJson }}
{{- end }}

{{/* A token: the given value, else the one already in the release's Secret (a generated token is
kept across upgrades), else a new random one. Call with (dict "root" $ "name" N "key" K "value" V).
lookup answers only a render with cluster access: under `helm template`, Argo CD or
--dry-run=client it returns nothing, so every such render draws a new token (values.yaml,
adminToken; NOTES.txt warns while any is generated). Not refused: a first install has none. */}}
{{- define "kvfence.token" -}}
{{- $token := .value }}
{{- if not $token }}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing (hasKey ($existing.data | default dict) .key) }}
{{- $token = index $existing.data .key | b64dec }}
{{- else }}
{{- $token = randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- $token }}
{{- end }}

{{/*
checksum/secrets of a pod that mounts the Secrets `uses` (a list of the keys above): the
sha256 of {name: data} of those the chart renders, as JSON. Empty when it renders none of them: a
user-provided Secret (existingSecret) is not in the chart, so no checksum can follow it.
Call with (dict "root" $ "uses" (list "node" "tls")).
*/}}
{{- define "kvfence.secretsChecksum" -}}
{{- $all := include "kvfence.renderedSecrets" .root | fromJson }}
{{- $used := dict }}
{{- range .uses }}
{{- with index $all . }}
{{- $_ := set $used .name .data }}
{{- end }}
{{- end }}
{{- if $used }}{{ $used | toJson | sha256sum }}{{ end }}
{{- end }}
