{{/*
The bundled Mosquitto's ConfigMap data: mosquitto.conf and, with mqtt.auth, the ACL. Its pods hash
it (checksum/config): Mosquitto reads both at start only.
*/}}
{{- define "kvfence.mosquittoConfig" -}}
{{- $m := .Values.mqtt }}
{{- $a := $m.auth }}
{{- $auth := include "kvfence.mqttAuth" . }}
{{- $reader := include "kvfence.mqttReader" . }}
# Mosquitto 2 listens on localhost only unless told otherwise. Events carry request ids, tenant
# names and counts (never prompt text), and consumers trust them: every client needs an account
# (mqtt.auth), besides the NetworkPolicy (networkPolicy.mqttFrom) on who may connect at all.
mosquitto.conf: |
  listener {{ int $m.port }}
  {{- /* mqtt.tls: the port speaks TLS only, with the files of mqtt.tls.existingSecret (the
         certificate reloader in mosquitto.yaml watches the same three) */}}
  {{- if $m.tls.enabled }}
  cafile /mosquitto/tls/ca.crt
  certfile /mosquitto/tls/tls.crt
  keyfile /mosquitto/tls/tls.key
  {{- end }}
  persistence false
  log_dest stdout
  {{- if $auth }}
  allow_anonymous false
  # Both written at pod start by the init container (hashed from the Secret, owned by mosquitto).
  password_file /mosquitto/auth/passwd
  acl_file /mosquitto/auth/acl
  {{- else }}
  # mqtt.auth.enabled=false. UNSAFE: anyone who can connect reads every tenant's events and can
  # publish forged ones.
  allow_anonymous true
  {{- end }}
{{- if $auth }}
# An authenticated client may do only what its account is granted here.
acl: |
  user {{ $a.username }}
  topic readwrite kvfence/v1/{{ .Values.clusterName }}/#
  {{- with $reader }}
  user {{ . }}
  topic read kvfence/v1/{{ $.Values.clusterName }}/#
  {{- end }}
{{- end }}
{{- end }}
