{{/* Names and labels. */}}
{{- define "kvfence.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvfence.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvfence.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvfence.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvfence.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfence.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvfence.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvfence.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfence
{{- end }}

{{/* Labels of one component; call with (dict "root" $ "component" "decode"). */}}
{{- define "kvfence.componentSelector" -}}
{{ include "kvfence.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvfence.componentLabels" -}}
{{ include "kvfence.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvfence.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvfence.controlPlaneHost" -}}
{{- printf "%s-control-plane.%s.svc" (include "kvfence.fullname" .) .Release.Namespace }}
{{- end }}

{{/* The name the control plane verifies node certificates against (tls.internalServerName): the
     nodes advertise pod IPs, which the one internal.crt every pod mounts cannot name. */}}
{{- define "kvfence.nodeTlsName" -}}
{{- default (printf "%s-node.%s.svc" (include "kvfence.fullname" .) .Release.Namespace) .Values.tls.internalServerName }}
{{- end }}

{{- define "kvfence.adminSecretName" -}}
{{- default (printf "%s-admin-token" (include "kvfence.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "kvfence.nodeSecretName" -}}
{{- default (printf "%s-node-token" (include "kvfence.fullname" .)) .Values.nodeToken.existingSecret }}
{{- end }}

{{/* The admin token, for the control plane and the scheduled tenant backup. */}}
{{- define "kvfence.adminTokenVolume" -}}
- name: admin-token
  secret:
    secretName: {{ include "kvfence.adminSecretName" . }}
    defaultMode: 0400
    items:
      - key: {{ .Values.adminToken.key }}
        path: {{ .Values.adminToken.key }}
{{- end }}

{{- define "kvfence.adminTokenMount" -}}
- name: admin-token
  mountPath: /etc/kvfence/admin
  readOnly: true
{{- end }}

{{- define "kvfence.nodeTokenVolume" -}}
- name: node-token
  secret:
    secretName: {{ include "kvfence.nodeSecretName" . }}
    defaultMode: 0400
    items:
      - key: {{ .Values.nodeToken.key }}
        path: {{ .Values.nodeToken.key }}
{{- end }}

{{- define "kvfence.nodeTokenMount" -}}
- name: node-token
  mountPath: /etc/kvfence/node
  readOnly: true
{{- end }}

{{- define "kvfence.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "kvfence.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* "true" when kvfence connects to its broker (bundled or external) with an account. */}}
{{- define "kvfence.mqttAuth" -}}
{{- if and .Values.mqtt.auth.enabled (or .Values.mqtt.enabled .Values.mqtt.externalUrl) }}true{{ end }}
{{- end }}

{{/* The bundled broker's read-only account, or "" when there is none. */}}
{{- define "kvfence.mqttReader" -}}
{{- if and .Values.mqtt.enabled (include "kvfence.mqttAuth" .) }}{{ .Values.mqtt.auth.readerUsername }}{{ end }}
{{- end }}

{{- define "kvfence.mqttSecretName" -}}
{{- default (printf "%s-mqtt" (include "kvfence.fullname" .)) .Values.mqtt.auth.existingSecret }}
{{- end }}

{{/* Values of mqtt.auth that no schema rule can refuse (they compare two values). */}}
{{- define "kvfence.checkMqttAuth" -}}
{{- $a := .Values.mqtt.auth }}
{{- if include "kvfence.mqttAuth" . }}
{{- if and (not .Values.mqtt.enabled) (not $a.existingSecret) (not $a.password) }}
{{- fail "mqtt.externalUrl with mqtt.auth.enabled: give the broker's password for mqtt.auth.username in mqtt.auth.existingSecret (or mqtt.auth.password), or set mqtt.auth.enabled=false for a broker that takes anonymous clients (unsafe: see values.yaml)" }}
{{- end }}
{{- if include "kvfence.mqttReader" . }}
{{- if eq $a.readerUsername $a.username }}
{{- fail (printf "mqtt.auth.readerUsername %q is mqtt.auth.username: the read-only account needs a name of its own (or \"\" for none)" $a.readerUsername) }}
{{- end }}
{{- if eq $a.readerPasswordKey $a.passwordKey }}
{{- fail (printf "mqtt.auth.readerPasswordKey %q is mqtt.auth.passwordKey: the two passwords need keys of their own" $a.passwordKey) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when kvfence speaks TLS to its broker (bundled or external). */}}
{{- define "kvfence.mqttTls" -}}
{{- if and .Values.mqtt.tls.enabled (or .Values.mqtt.enabled .Values.mqtt.externalUrl) }}true{{ end }}
{{- end }}

{{- define "kvfence.checkMqttTls" -}}
{{- if and .Values.mqtt.tls.enabled (not .Values.mqtt.tls.existingSecret) }}
{{- fail "mqtt.tls.enabled: give mqtt.tls.existingSecret, a Secret holding tls.crt, tls.key and ca.crt (what a cert-manager Certificate writes; the certificate must name the broker's Service) for the bundled broker, or ca.crt alone (the CA of the broker's certificate) for mqtt.externalUrl" }}
{{- end }}
{{- end }}

{{/* The broker's CA, for kvfence pods (events.mqtt_tls_ca_file). */}}
{{- define "kvfence.mqttTlsVolume" -}}
- name: mqtt-tls
  secret:
    secretName: {{ .Values.mqtt.tls.existingSecret }}
    defaultMode: 0444  # a CA certificate: nothing secret
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}

{{- define "kvfence.mqttTlsMount" -}}
- name: mqtt-tls
  mountPath: /etc/kvfence/mqtt-tls
  readOnly: true
{{- end }}

{{/* The kvfence account's password, for kvfence pods (events.mqtt_password_file). */}}
{{- define "kvfence.mqttPasswordVolume" -}}
- name: mqtt-password
  secret:
    secretName: {{ include "kvfence.mqttSecretName" . }}
    defaultMode: 0400
    items:
      - key: {{ .Values.mqtt.auth.passwordKey }}
        path: password
{{- end }}

{{- define "kvfence.mqttPasswordMount" -}}
- name: mqtt-password
  mountPath: /etc/kvfence/mqtt
  readOnly: true
{{- end }}

{{/* MQTT host and port: the bundled broker, the external URL, or none. */}}
{{- define "kvfence.mqttHostPort" -}}
{{- if .Values.mqtt.enabled }}
{{- printf "%s-mosquitto.%s.svc:%d" (include "kvfence.fullname" .) .Release.Namespace (int .Values.mqtt.port) }}
{{- else if .Values.mqtt.externalUrl }}
{{- $u := urlParse .Values.mqtt.externalUrl }}
{{- if not (has $u.scheme (list "mqtt" "tcp" "mqtts" "ssl")) }}
{{- fail (printf "mqtt.externalUrl %q: scheme must be mqtt://, tcp://, mqtts:// or ssl://" .Values.mqtt.externalUrl) }}
{{- end }}
{{- $tls := has $u.scheme (list "mqtts" "ssl") }}
{{- if and $tls (not .Values.mqtt.tls.enabled) }}
{{- fail (printf "mqtt.externalUrl %q is TLS: set mqtt.tls.enabled=true with mqtt.tls.existingSecret holding ca.crt, the CA of the broker's certificate" .Values.mqtt.externalUrl) }}
{{- end }}
{{- if contains ":" $u.host }}{{ $u.host }}{{ else }}{{ printf "%s:%d" $u.host (ternary 8883 1883 $tls) }}{{ end }}
{{- end }}
{{- end }}

{{/* A pool in the kvfence config format: {num_pages: N} or {memory_bytes: N}. */}}
{{- define "kvfence.pool" -}}
{{- if .numPages }}
num_pages: {{ int64 .numPages }}
{{- else }}
memory_bytes: {{ int64 .memoryBytes }}
{{- end }}
{{- end }}

{{/*
Pools given as page counts are compared with the context window here, at render time: JSON schema
cannot compare two values of the instance (it has no arithmetic and no $data), so values.schema.json
cannot say numPages * pageSize >= contextWindow. Pools given as memoryBytes need the model shape;
the pre-install hook checks those with the same code kvfence runs (`kvfence check-config --static`).
*/}}
{{- define "kvfence.checkPools" -}}
{{- $m := .Values.model }}
{{- $ctx := 0 }}
{{- if $m.contextWindow }}{{ $ctx = int64 $m.contextWindow }}
{{- else if $m.shape }}{{ $ctx = int64 $m.shape.contextWindow }}
{{- else if not $m.path }}{{ $ctx = int64 (include "kvfence.tinyContextWindow" .) }}
{{- end }}
{{- if and $ctx (not $m.clampContext) }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := (index $.Values $role).pool }}
{{- if $pool.numPages }}
{{- $tokens := mul (int64 $pool.numPages) (int64 $.Values.kv.pageSize) }}
{{- if lt $tokens $ctx }}
{{- fail (printf "%s.pool holds %d tokens (%d pages x kv.pageSize %d) < model context window %d: enlarge the pool or set model.clampContext=true to refuse longer requests on purpose" $role $tokens (int64 $pool.numPages) (int64 $.Values.kv.pageSize) $ctx) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
control_plane.default_deadline_s must not exceed control_plane.max_deadline_s (kvfence/config.py
refuses it at start, and the pre-install hook with it); JSON schema cannot compare two values.
*/}}
{{- define "kvfence.checkDeadlines" -}}
{{- $cp := .Values.controlPlane }}
{{- if gt (float64 $cp.defaultDeadlineS) (float64 $cp.maxDeadlineS) }}
{{- fail (printf "controlPlane.defaultDeadlineS %v exceeds controlPlane.maxDeadlineS %v: kvfence refuses a default deadline over the longest one a client may ask; lower defaultDeadlineS or raise maxDeadlineS" $cp.defaultDeadlineS $cp.maxDeadlineS) }}
{{- end }}
{{- end }}

{{/*
control_plane.admission_queue_per_tenant, when set, must not exceed control_plane.admission_queue
(kvfence/config.py refuses it at start, and the pre-install hook with it: without the hook,
configCheck.enabled=false, the control plane would crash-loop). Left null the chart does not
write the key, and kvfence cuts its default, 64, to a lower admission_queue; JSON schema cannot
compare two values.
*/}}
{{- define "kvfence.checkAdmissionQueue" -}}
{{- $cp := .Values.controlPlane }}
{{- if not (kindIs "invalid" $cp.admissionQueuePerTenant) }}
{{- if gt (int64 $cp.admissionQueuePerTenant) (int64 $cp.admissionQueue) }}
{{- fail (printf "controlPlane.admissionQueuePerTenant %v exceeds controlPlane.admissionQueue %v: one tenant's share of the queue cannot be larger than the queue, and kvfence refuses the config at start; lower admissionQueuePerTenant, or leave it null (64, cut to admissionQueue when that is lower; an upgrade with --reuse-values keeps an earlier chart's explicit 64: pass --set controlPlane.admissionQueuePerTenant=null)" $cp.admissionQueuePerTenant $cp.admissionQueue) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
control_plane.refused_room_max_s must be at most half of transfer.reservation_timeout_s
(kvfence/config.py, refused_room_bound_s, refuses it at start, and the pre-install hook with it:
the chart always sets the key, so kvfence never cuts its default down for it); JSON schema cannot
compare two values.
*/}}
{{- define "kvfence.checkRefusedRoom" -}}
{{- $room := float64 .Values.controlPlane.refusedRoomMaxS }}
{{- $timeout := float64 .Values.transfer.reservationTimeoutS }}
{{- if gt $room (divf $timeout 2) }}
{{- fail (printf "controlPlane.refusedRoomMaxS %v exceeds %v, half of transfer.reservationTimeoutS %v: requests waiting for prefill room fail NO_CAPACITY after 0.75 x reservationTimeoutS, and a prefill node that refused for room must be back in routing within 2/3 of that wait; lower refusedRoomMaxS or raise reservationTimeoutS" .Values.controlPlane.refusedRoomMaxS (divf $timeout 2) .Values.transfer.reservationTimeoutS) }}
{{- end }}
{{- end }}

{{/*
control_plane.node_timeout_s must be at least 2 x heartbeat_interval_s (kvfence/config.py,
NODE_TIMEOUT_HEARTBEATS, refuses it at start, and the pre-install hook with it: without the hook,
configCheck.enabled=false, every pod would crash-loop); JSON schema cannot compare two values.
*/}}
{{- define "kvfence.checkNodeTimeout" -}}
{{- $cp := .Values.controlPlane }}
{{- if lt (float64 $cp.nodeTimeoutS) (mulf 2 (float64 $cp.heartbeatIntervalS)) }}
{{- fail (printf "controlPlane.nodeTimeoutS %v is under 2 x controlPlane.heartbeatIntervalS %v: one late heartbeat would drop a healthy node, and kvfence refuses the config at start; raise nodeTimeoutS to at least %v or lower heartbeatIntervalS" $cp.nodeTimeoutS $cp.heartbeatIntervalS (mulf 2 (float64 $cp.heartbeatIntervalS))) }}
{{- end }}
{{- end }}

{{/*
"true" when a UCX_TLS value lets UCX use its TCP transport: a list naming tcp or all, or a
"^..." list (all but those) that does not exclude tcp. A name may carry a ":aux" suffix.
*/}}
{{- define "kvfence.ucxUsesTcp" -}}
{{- $tls := . | trim | lower }}
{{- $names := list }}
{{- range splitList "," (trimPrefix "^" $tls) }}
{{- $names = append $names (. | trim | splitList ":" | first) }}
{{- end }}
{{- if hasPrefix "^" $tls }}
{{- if not (has "tcp" $names) }}true{{ end }}
{{- else if or (has "tcp" $names) (has "all" $names) }}true{{ end }}
{{- end }}

{{/*
A role's ucx.tcpPortRange; call with (dict "root" $ "role" "decode"). The schema takes two
numbers of up to five digits; their bounds and order are checked here: they become the
NetworkPolicy's port and endPort, which the API server would refuse at install. "" leaves UCX's
TCP transport on an ephemeral port, which no NetworkPolicy can name: with the policy on and TCP
in ucx.tls every connection to it would be dropped. Decode's range takes prefill's connections
(the KV transfers); prefill's takes decode's, as UCX's TCP transport may connect from either
side of an endpoint (networkpolicy.yaml opens it to decode).
*/}}
{{- define "kvfence.checkUcxPortRange" -}}
{{- $role := .role }}
{{- $v := index .root.Values $role }}
{{- $peer := ternary "prefill" "decode" (eq $role "decode") }}
{{- $example := ternary "13440-13449" "13340-13349" (eq $role "decode") }}
{{- with $v.ucx.tcpPortRange }}
{{- $r := splitList "-" . }}
{{- $lo := atoi (first $r) }}
{{- $hi := atoi (last $r) }}
{{- if or (lt $lo 1) (gt $lo 65535) (lt $hi 1) (gt $hi 65535) }}
{{- fail (printf "%s.ucx.tcpPortRange %q: both ports must lie within 1-65535 (e.g. %q)" $role . $example) }}
{{- end }}
{{- if gt $lo $hi }}
{{- fail (printf "%s.ucx.tcpPortRange %q is reversed: give the low port first (%d-%d)" $role . $hi $lo) }}
{{- end }}
{{- else }}
{{- if and .root.Values.networkPolicy.enabled (include "kvfence.ucxUsesTcp" $v.ucx.tls) }}
{{- fail (printf "%s.ucx.tcpPortRange is \"\" with networkPolicy.enabled and %s.ucx.tls %q (UCX's TCP transport): the transport would listen on an ephemeral port, which the %s NetworkPolicy cannot open to %s pods, and every KV transfer would be blocked. Set %s.ucx.tcpPortRange (e.g. %q), or networkPolicy.enabled=false" $role $role $v.ucx.tls $role $peer $role $example) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A service's ports, each bound in the same pod: two equal (metrics on the gRPC port) or one inside
the role's ucx.tcpPortRange, from which UCX's TCP transport binds, render and install fine and
then fail at bind, in a crash loop. Call with (dict "root" $ "role" ROLE) after
kvfence.checkUcxPortRange; ROLE "control-plane" checks controlPlane.ports.
*/}}
{{- define "kvfence.checkPorts" -}}
{{- $role := .role }}
{{- $prefix := ternary "controlPlane" $role (eq $role "control-plane") }}
{{- $v := index .root.Values $prefix }}
{{- $names := ternary (list "grpc" "admin" "metrics") (list "grpc" "ucx" "metrics") (eq $role "control-plane") }}
{{- $seen := dict }}
{{- range $name := $names }}
{{- $port := int (index $v.ports $name) }}
{{- with index $seen (toString $port) }}
{{- fail (printf "%s.ports.%s and %s.ports.%s are both %d: one pod cannot bind a port twice; give each its own" $prefix . $prefix $name $port) }}
{{- end }}
{{- $_ := set $seen (toString $port) $name }}
{{- end }}
{{- if ne $role "control-plane" }}
{{- with $v.ucx.tcpPortRange }}
{{- $r := splitList "-" . }}
{{- $lo := atoi (first $r) }}
{{- $hi := atoi (last $r) }}
{{- range $names }}
{{- $port := int (index $v.ports .) }}
{{- if and (ge $port $lo) (le $port $hi) }}
{{- fail (printf "%s.ports.%s %d lies inside %s.ucx.tcpPortRange %q, from which UCX's TCP transport binds its listening ports in the same pod: move the port or the range" $prefix . $port $prefix $v.ucx.tcpPortRange) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* max_position_embeddings of the embedded tiny model (kvfence/model/tiny.py); a test keeps them equal. */}}
{{- define "kvfence.tinyContextWindow" -}}
2048
{{- end }}

{{/* The kvfence config file (kvfence/config.py); per-pod fields (node.*) come from env. */}}
{{- define "kvfence.config" -}}
{{- include "kvfence.checkPools" . }}
{{- include "kvfence.checkMqttAuth" . }}
{{- include "kvfence.checkMqttTls" . }}
{{- include "kvfence.checkDeadlines" . }}
{{- include "kvfence.checkAdmissionQueue" . }}
{{- include "kvfence.checkRefusedRoom" . }}
{{- include "kvfence.checkNodeTimeout" . }}
{{- $m := .Values.model -}}
{{- $cp := .Values.controlPlane -}}
cluster: {{ .Values.clusterName | quote }}
model:
  name: {{ $m.name | quote }}
  {{- if $m.path }}
  path: {{ $m.path | quote }}
  {{- end }}
  dtype: {{ $m.dtype }}
  {{- if $m.contextWindow }}
  context_window: {{ int64 $m.contextWindow }}
  {{- end }}
  clamp_context: {{ $m.clampContext }}
  {{- with $m.shape }}
  shape:
    num_layers: {{ int64 .numLayers }}
    num_kv_heads: {{ int64 .numKvHeads }}
    head_dim: {{ int64 .headDim }}
    context_window: {{ int64 .contextWindow }}
  {{- end }}
kv:
  page_size: {{ int64 .Values.kv.pageSize }}
  prefill_pool:
    {{- include "kvfence.pool" .Values.prefill.pool | trim | nindent 4 }}
  decode_pool:
    {{- include "kvfence.pool" .Values.decode.pool | trim | nindent 4 }}
  scrub_on_free: {{ .Values.kv.scrubOnFree }}
transfer:
  max_batch_bytes: {{ int64 .Values.transfer.maxBatchBytes }}
  batch_timeout_s: {{ .Values.transfer.batchTimeoutS }}
  reservation_timeout_s: {{ .Values.transfer.reservationTimeoutS }}
  endpoint_pool_max_idle: {{ int .Values.transfer.endpointPoolMaxIdle }}
  endpoint_idle_timeout_s: {{ .Values.transfer.endpointIdleTimeoutS }}
  max_unverified_connections: {{ int64 .Values.transfer.maxUnverifiedConnections }}
prefill:
  max_batch_tokens: {{ int .Values.prefill.maxBatchTokens }}
decode:
  max_batch: {{ int .Values.decode.maxBatch }}
  stream_interval: {{ int .Values.decode.streamInterval }}
control_plane:
  listen: {{ printf "0.0.0.0:%d" (int $cp.ports.grpc) | quote }}
  admin_listen: {{ printf "0.0.0.0:%d" (int $cp.ports.admin) | quote }}
  address: {{ printf "%s:%d" (include "kvfence.controlPlaneHost" .) (int $cp.ports.grpc) | quote }}
  state_dir: /var/lib/kvfence
  admission_queue: {{ int64 $cp.admissionQueue }}
  {{- /* only when set: kvfence's default, 64, is then cut to a lower admission_queue */}}
  {{- if not (kindIs "invalid" $cp.admissionQueuePerTenant) }}
  admission_queue_per_tenant: {{ int64 $cp.admissionQueuePerTenant }}
  {{- end }}
  no_node_wait_s: {{ $cp.noNodeWaitS }}
  failures_to_cool: {{ int64 $cp.failuresToCool }}
  failure_cooldown_s: {{ $cp.failureCooldownS }}
  refused_room_max_s: {{ $cp.refusedRoomMaxS }}
  default_deadline_s: {{ $cp.defaultDeadlineS }}
  max_deadline_s: {{ $cp.maxDeadlineS }}
  heartbeat_interval_s: {{ $cp.heartbeatIntervalS }}
  node_timeout_s: {{ $cp.nodeTimeoutS }}
  {{- /* here, not in controlPlane.env, so that the pre-install hook checks it */}}
  {{- if not (kindIs "invalid" $cp.maxRequestBytes) }}
  max_request_bytes: {{ int64 $cp.maxRequestBytes }}
  {{- end }}
  admin_token_file: /etc/kvfence/admin/{{ .Values.adminToken.key }}
  node_token_file: /etc/kvfence/node/{{ .Values.nodeToken.key }}
events:
  {{- with include "kvfence.mqttHostPort" . }}
  mqtt_host: {{ (split ":" .)._0 | quote }}
  {{- /* a number, decimal (atoi: the schema allows no leading zero, which YAML would read as
         octal, and sprig's int would too) */}}
  mqtt_port: {{ (split ":" .)._1 | atoi }}
  {{- else }}
  mqtt_host: null
  {{- end }}
  buffer_size: {{ int64 .Values.mqtt.bufferSize }}
  {{- if include "kvfence.mqttAuth" . }}
  mqtt_username: {{ .Values.mqtt.auth.username | quote }}
  mqtt_password_file: /etc/kvfence/mqtt/password
  {{- end }}
  {{- if include "kvfence.mqttTls" . }}
  mqtt_tls_ca_file: /etc/kvfence/mqtt-tls/ca.crt
  {{- end }}
{{- if .Values.tls.enabled }}
tls:
  public_cert: /etc/kvfence/tls/public.crt
  public_key: /etc/kvfence/tls/public.key
  internal_ca: /etc/kvfence/tls/ca.crt
  internal_cert: /etc/kvfence/tls/internal.crt
  internal_key: /etc/kvfence/tls/internal.key
  internal_server_name: {{ include "kvfence.nodeTlsName" . | quote }}
{{- end }}
{{- end }}

{{/* Env shared by every kvfence container: role, pod identity. Call with (dict "root" $ "role" "decode"). */}}
{{- define "kvfence.nodeEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: KVFENCE__NODE__ROLE
  value: {{ .role | quote }}
- name: KVFENCE__NODE__NODE_ID
  value: "$(POD_NAME)"
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: HOME
  value: /tmp
{{- end }}

{{/* gRPC probes; Kubernetes gRPC probes speak plaintext only, so with TLS they check TCP. Call
     with (dict "root" $ "port" P "startupTimeoutS" S): the startup probe gives the service S
     seconds (at least one 5 s period) to start serving before the kubelet restarts it. */}}
{{- define "kvfence.probes" -}}
{{- $check := dict "grpc" (dict "port" (int .port)) }}
{{- if .root.Values.tls.enabled }}{{ $check = dict "tcpSocket" (dict "port" (int .port)) }}{{ end -}}
{{- $period := 5 }}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $period }}
  failureThreshold: {{ max 1 (int (ceil (divf (float64 .startupTimeoutS) $period))) }}
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  failureThreshold: 6
  timeoutSeconds: 5
{{- end }}

{{/*
The TLS Secret's keys a service reads (kvfence/tls.py): prefill and decode serve and verify with
the internal CA and certificate only, and reach the registry trusting ca.crt (they never read
public.crt or public.key: tls.public_cert in their config only tells them the registry speaks
TLS). public.key is the public and admin endpoints' private key: a node pod, which runs model
code and takes tenants' KV, has no business holding it. The control plane serves the public
endpoint and calls the nodes: all five.
*/}}
{{- define "kvfence.tlsKeys" -}}
{{- if eq . "control-plane" }}public.crt,public.key,ca.crt,internal.crt,internal.key
{{- else }}ca.crt,internal.crt,internal.key
{{- end }}
{{- end }}

{{/* Volumes for the config, /tmp and the TLS material; call with (dict "root" $ "role" ROLE). */}}
{{- define "kvfence.commonVolumes" -}}
{{- $root := .root }}
- name: config
  configMap:
    name: {{ include "kvfence.fullname" $root }}-config
- name: tmp
  emptyDir: {}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "kvfence.tlsSecretName" $root }}
    defaultMode: 0440
    items:
      {{- range splitList "," (include "kvfence.tlsKeys" .role) }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- end }}
{{- end }}

{{- define "kvfence.commonMounts" -}}
- name: config
  mountPath: /etc/kvfence/config.yaml
  subPath: config.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/kvfence/tls
  readOnly: true
{{- end }}
{{- end }}
