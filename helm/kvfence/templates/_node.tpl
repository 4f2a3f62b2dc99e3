{{/*
A prefill or decode Deployment; call with (dict "root" $ "role" "prefill"). Both read the same config
file; the role, identity and addresses of each pod come from KVFENCE__NODE__* env.
*/}}
{{- define "kvfence.nodeDeployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $sel := dict "root" $root "component" $role }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- range $dev := list $v.gpu $v.rdma }}
{{- if $dev.enabled }}
{{- /* Extended resources: a limit is required; a request, if given, must equal it. */}}
{{- $_ := set $limits $dev.resourceName (int $dev.count) }}
{{- $_ := set $requests $dev.resourceName (int $dev.count) }}
{{- end }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- include "kvfence.checkUcxPortRange" (dict "root" $root "role" $role) }}
{{- include "kvfence.checkPorts" (dict "root" $root "role" $role) }}
{{- /* A pod holding a device (an extended resource: a name with a domain, as gpu and rdma add;
       or a resource claim) may have no spare one to surge into: Kubernetes' default rollout
       (maxSurge 25% rounded up, maxUnavailable 25% rounded down: 1 and 0 under 4 replicas)
       starts a new pod first, which stays Pending, and removes no old one. The chart's strategy
       replaces pods instead (values.yaml, prefill.strategy). Native resources (cpu, memory,
       ephemeral-storage, hugepages-*) have no "/". */}}
{{- $devices := $resources.claims }}
{{- range $name, $_ := merge (dict) $limits $requests }}
{{- if contains "/" $name }}{{ $devices = true }}{{ end }}
{{- end }}
{{- $strategy := $v.strategy }}
{{- /* What the API server would refuse at install. */}}
{{- with $strategy }}
{{- if and (eq (.type | default "RollingUpdate") "Recreate") (hasKey . "rollingUpdate") }}
{{- fail (printf "%s.strategy: type Recreate takes no rollingUpdate (drop one of the two)" $role) }}
{{- end }}
{{- $ru := .rollingUpdate | default dict }}
{{- $zero := list "0" "0%" }}
{{- if and (has (toString $ru.maxSurge) $zero) (has (toString $ru.maxUnavailable) $zero) }}
{{- fail (printf "%s.strategy.rollingUpdate: maxSurge and maxUnavailable are both 0, so a rollout could never replace a pod: give maxUnavailable 1 (each old pod stopped frees its device for its replacement) or a maxSurge (needs a spare device)" $role) }}
{{- end }}
{{- end }}
{{- if and (not $strategy) $devices }}
{{- $strategy = dict "type" "RollingUpdate" "rollingUpdate" (dict "maxSurge" 0 "maxUnavailable" 1) }}
{{- end }}
{{- /* On SIGTERM a node drains for at most drainTimeoutS (node.drain_timeout_s), then stops: the
       pod's grace period must outlast both, or Kubernetes kills it with its requests running.
       The stop after the drain takes at most 15 s (kvfence.node_main.STOP_TAIL_S) when the
       broker or a transfer does not answer; the default adds that. */}}
{{- $drain := $v.drainTimeoutS }}
{{- $grace := $v.terminationGracePeriodSeconds | default (add (int (ceil $drain)) 15) }}
{{- if le (float64 $grace) (float64 $drain) }}
{{- fail (printf "%s.terminationGracePeriodSeconds %v must exceed %s.drainTimeoutS %v: the pod would be killed while it drains" $role $grace $role $drain) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kvfence.fullname" $root }}-{{ $role }}
  labels:
    {{- include "kvfence.componentLabels" $sel | nindent 4 }}
spec:
  replicas: {{ int $v.replicas }}
  {{- with $strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvfence.componentSelector" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvfence.componentSelector" $sel | nindent 8 }}
      annotations:
        checksum/config: {{ include "kvfence.config" $root | sha256sum }}
        {{- /* it reads the node token, the TLS files and the MQTT password once, at start */}}
        {{- with include "kvfence.secretsChecksum" (dict "root" $root "uses" (list "node" "tls" "mqttPublisher")) }}
        checksum/secrets: {{ . }}
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ int $grace }}
      containers:
        - name: {{ $role }}
          image: {{ include "kvfence.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["kvfence", "serve", {{ $role | quote }}, "--config", "/etc/kvfence/config.yaml"]
          ports:
            - {name: grpc, containerPort: {{ int $v.ports.grpc }}, protocol: TCP}
            - {name: ucx, containerPort: {{ int $v.ports.ucx }}, protocol: TCP}
            - {name: metrics, containerPort: {{ int $v.ports.metrics }}, protocol: TCP}
          env:
            {{- include "kvfence.nodeEnv" (dict "root" $root "role" $role) | nindent 12 }}
            - name: KVFENCE__NODE__LISTEN
              value: {{ printf "0.0.0.0:%d" (int $v.ports.grpc) | quote }}
            {{- /* Bare on an IPv6 pod ("fd00::1:50061"): kvfence brackets an IPv6 host
                   (kvfence/config.py). The UCX host stays bare: its address is split at the
                   last colon. */}}
            - name: KVFENCE__NODE__ADVERTISE
              value: {{ printf "$(POD_IP):%d" (int $v.ports.grpc) | quote }}
            - name: KVFENCE__NODE__UCX_HOST
              value: "$(POD_IP)"
            - name: KVFENCE__NODE__UCX_PORT
              value: {{ $v.ports.ucx | int | quote }}
            - name: KVFENCE__NODE__METRICS_PORT
              value: {{ $v.ports.metrics | int | quote }}
            - name: KVFENCE__NODE__METRICS_HOST  # Prometheus scrapes the pod's address
              value: "0.0.0.0"
            - name: KVFENCE__NODE__DRAIN_TIMEOUT_S
              value: {{ $drain | toString | quote }}
            - name: UCX_TLS
              value: {{ $v.ucx.tls | quote }}
            {{- with $v.ucx.netDevices }}
            - name: UCX_NET_DEVICES
              value: {{ . | quote }}
            {{- end }}
            {{- with $v.ucx.tcpPortRange }}
            - name: UCX_TCP_PORT_RANGE
              value: {{ . | quote }}
            {{- end }}
            - name: UCX_WARN_UNUSED_ENV_VARS
              value: "n"
            {{- range $name, $value := $v.ucx.extraEnv }}
            - name: {{ $name }}
              value: {{ $value | toString | quote }}
            {{- end }}
            {{- if not $v.gpu.enabled }}
            - name: CUDA_VISIBLE_DEVICES
              value: ""
            {{- end }}
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "kvfence.probes" (dict "root" $root "port" $v.ports.grpc "startupTimeoutS" $v.startupTimeoutS) | nindent 10 }}
          securityContext:
            {{- $sc := deepCopy $root.Values.securityContext }}
            {{- if $v.rdma.ipcLock }}
            {{- /* Registering KV pages with the HCA pins them. IPC_LOCK lifts the memlock limit
                   only for a process running as root (a non-root process gets no capability
                   from the container's bounding set), and Pod Security baseline and restricted
                   refuse it: added only when rdma.ipcLock asks for it. As runAsUser 10001 the
                   pods need the node runtime's memlock limit raised (values.yaml, prefill.rdma). */}}
            {{- $caps := deepCopy ($sc.capabilities | default dict) }}
            {{- $_ := set $caps "add" (concat ($caps.add | default list) (list "IPC_LOCK") | uniq) }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            {{- include "kvfence.commonMounts" $root | nindent 12 }}
            {{- include "kvfence.nodeTokenMount" $root | nindent 12 }}
            {{- if include "kvfence.mqttAuth" $root }}
            {{- include "kvfence.mqttPasswordMount" $root | nindent 12 }}
            {{- end }}
            {{- if include "kvfence.mqttTls" $root }}
            {{- include "kvfence.mqttTlsMount" $root | nindent 12 }}
            {{- end }}
            - name: shm
              mountPath: /dev/shm
            {{- /* control_plane.state_dir: where a node writes the embedded model when no
                   model.path is set (the root filesystem is read-only) */}}
            - name: state
              mountPath: /var/lib/kvfence
            {{- if $root.Values.model.volume }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "kvfence.commonVolumes" (dict "root" $root "role" $role) | nindent 8 }}
        {{- include "kvfence.nodeTokenVolume" $root | nindent 8 }}
        {{- if include "kvfence.mqttAuth" $root }}
        {{- include "kvfence.mqttPasswordVolume" $root | nindent 8 }}
        {{- end }}
        {{- if include "kvfence.mqttTls" $root }}
        {{- include "kvfence.mqttTlsVolume" $root | nindent 8 }}
        {{- end }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize | quote }}
        - name: state
          emptyDir:
            sizeLimit: 64Mi
        {{- with $root.Values.model.volume }}
        - name: model
          {{- toYaml . | nindent 10 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- /* With one replica no PDB helps: maxUnavailable 0 would block every node drain forever, 1
       lets a drain evict the only pod (the role has no node until its replacement starts),
       the same as no PDB. So none is rendered below two replicas; from two, one that allows
       every pod to go at once would protect nothing and is refused. */}}
{{- if and $v.pdb.enabled (gt (int $v.replicas) 1) }}
{{- if ge (int $v.pdb.maxUnavailable) (int $v.replicas) }}
{{- fail (printf "%s.pdb.maxUnavailable %d is not below %s.replicas %d: the PodDisruptionBudget would let a node drain evict every %s pod at once; lower maxUnavailable (1 keeps %d of %d serving), or set %s.pdb.enabled=false" $role (int $v.pdb.maxUnavailable) $role (int $v.replicas) $role (sub (int $v.replicas) 1) (int $v.replicas) $role) }}
{{- end }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvfence.fullname" $root }}-{{ $role }}
  labels:
    {{- include "kvfence.componentLabels" $sel | nindent 4 }}
spec:
  maxUnavailable: {{ int $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvfence.componentSelector" $sel | nindent 6 }}
{{- end }}
{{- end }}
