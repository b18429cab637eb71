{{/* Names */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.fullname" -}}
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

{{/* <fullname>-<suffix>, within 63 characters */}}
{{- define "kvroute.component" -}}
{{- printf "%s-%s" (include "kvroute.fullname" .root) .name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: call with (dict "root" $ "component" "router") */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .root }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the admin token, and its key */}}
{{- define "kvroute.adminSecretName" -}}
{{- default (include "kvroute.component" (dict "root" . "name" "admin")) .Values.admin.existingSecret -}}
{{- end -}}

{{/* The shared index is on when a Redis is deployed or given */}}
{{- define "kvroute.sharedIndex" -}}
{{- if or .Values.redis.enabled .Values.redis.external.url .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.redisURL" -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s:%v/0" (include "kvroute.component" (dict "root" . "name" "redis")) .Values.redis.port -}}
{{- end -}}
{{- end -}}

{{/* The namespace discovery watches (the Role lives there) */}}
{{- define "kvroute.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.kubernetes.namespace -}}
{{- end -}}

{{/* The label selector discovery uses: given, or the InferencePool's matchLabels in epp mode */}}
{{- define "kvroute.discoverySelector" -}}
{{- if .Values.discovery.kubernetes.selector -}}
{{- .Values.discovery.kubernetes.selector -}}
{{- else if and .Values.epp.enabled .Values.inferencePool.selector -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.inferencePool.selector -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
{{- end -}}

{{/*
kvroute.yaml: .Values.config with the keys the chart owns (host, port, the shared index, discovery).
*/}}
{{- define "kvroute.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "host" "0.0.0.0" -}}
{{- $_ := set $cfg "port" (int (ternary .Values.router.port .Values.epp.httpPort .Values.router.enabled)) -}}
{{- $index := deepCopy (default dict $cfg.index) -}}
{{- if include "kvroute.sharedIndex" . -}}
{{- $_ := set $index "backend" "redis" -}}
{{- $_ := set $index "redis_prefix" .Values.redis.prefix -}}
{{- with include "kvroute.redisURL" . -}}
{{- $_ := set $index "redis_url" . -}}
{{- end -}}
{{- if .Values.redis.external.cluster -}}
{{- $_ := set $index "redis_cluster" true -}}
{{- end -}}
{{- $_ := set $index "subscribe" (not .Values.indexer.enabled) -}}
{{- end -}}
{{- if $index -}}
{{- $_ := set $cfg "index" $index -}}
{{- end -}}
{{- $discovery := dict -}}
{{- with .Values.discovery.kubernetes -}}
{{- if .enabled -}}
{{- $k8s := dict "namespace" (include "kvroute.discoveryNamespace" $) "selector" (include "kvroute.discoverySelector" $) -}}
{{- if .port -}}{{- $_ := set $k8s "port" (int .port) -}}{{- end -}}
{{- if .portName -}}{{- $_ := set $k8s "port_name" .portName -}}{{- end -}}
{{- if .eventsPort -}}{{- $_ := set $k8s "events_port" (int .eventsPort) -}}{{- end -}}
{{- if .replayPort -}}{{- $_ := set $k8s "replay_port" (int .replayPort) -}}{{- end -}}
{{- $_ := set $discovery "kubernetes" $k8s -}}
{{- end -}}
{{- end -}}
{{- with .Values.discovery.dns -}}
{{- if .enabled -}}
{{- $dns := dict "name" .name "interval_s" .intervalS -}}
{{- if .srv -}}{{- $_ := set $dns "srv" true -}}{{- end -}}
{{- if .port -}}{{- $_ := set $dns "port" (int .port) -}}{{- end -}}
{{- $_ := set $discovery "dns" $dns -}}
{{- end -}}
{{- end -}}
{{- if and $discovery (not (kindIs "invalid" .Values.discovery.graceS)) -}}
{{- $_ := set $discovery "grace_s" .Values.discovery.graceS -}}
{{- end -}}
{{- if $discovery -}}
{{- $_ := set $cfg "discovery" $discovery -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Checks that stop a render which could not work */}}
{{- define "kvroute.validate" -}}
{{- $shared := include "kvroute.sharedIndex" . -}}
{{- if and .Values.router.enabled (gt (int .Values.router.replicas) 1) (not $shared) -}}
{{- fail "router.replicas > 1 needs the shared Redis index: set redis.enabled=true or redis.external.url (each replica would otherwise keep its own, partial index)" -}}
{{- end -}}
{{- if and .Values.epp.enabled (gt (int .Values.epp.replicas) 1) (not $shared) -}}
{{- fail "epp.replicas > 1 needs the shared Redis index: set redis.enabled=true or redis.external.url" -}}
{{- end -}}
{{- if and .Values.redis.external.cluster (not (or .Values.redis.external.url .Values.redis.external.existingSecret)) -}}
{{- fail "redis.external.cluster needs redis.external.url (or existingSecret): the chart's own Redis is a single node" -}}
{{- end -}}
{{- if and .Values.epp.enabled .Values.inferencePool.enabled (not .Values.inferencePool.selector) -}}
{{- fail "inferencePool.selector (the matchLabels of the vLLM pods) is required in epp mode" -}}
{{- end -}}
{{- if and .Values.discovery.kubernetes.enabled (not (include "kvroute.discoverySelector" .)) -}}
{{- fail "discovery.kubernetes.selector (e.g. app=vllm-llama) is required with discovery.kubernetes.enabled" -}}
{{- end -}}
{{- if and .Values.discovery.kubernetes.enabled (not (or .Values.discovery.kubernetes.port .Values.discovery.kubernetes.portName)) -}}
{{- fail "discovery.kubernetes needs the pods' port or portName" -}}
{{- end -}}
{{- if and .Values.discovery.dns.enabled (not (or .Values.discovery.dns.port .Values.discovery.dns.srv)) -}}
{{- fail "discovery.dns needs the workers' port (or srv: true)" -}}
{{- end -}}
{{- /* `kvroute indexer` subscribes to the static workers list only (it exits without one): remove this
check once it follows discovery too. */ -}}
{{- if and (include "kvroute.sharedIndex" .) .Values.indexer.enabled (or .Values.discovery.kubernetes.enabled .Values.discovery.dns.enabled) (not .Values.config.workers) -}}
{{- fail "the stand-alone indexer (kvroute indexer) reads only config.workers, not discovery: list the workers, or run one replica with the embedded index" -}}
{{- end -}}
{{- if and .Values.discovery.dns.enabled (not .Values.discovery.dns.name) -}}
{{- fail "discovery.dns.name is required with discovery.dns.enabled" -}}
{{- end -}}
{{- if not (or .Values.router.enabled .Values.epp.enabled) -}}
{{- fail "nothing to run: enable router or epp" -}}
{{- end -}}
{{- if hasKey .Values.config "admin_token" -}}
{{- fail "config.admin_token: use admin.token or admin.existingSecret (it is read from a Secret)" -}}
{{- end -}}
{{- if hasKey .Values.config "discovery" -}}
{{- fail "config.discovery: use the discovery.* values (they are rendered into kvroute.yaml)" -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by the kvroute containers: the admin token, the Redis URL from a Secret */}}
{{- define "kvroute.env" -}}
- name: KVROUTE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.adminSecretName" . }}
      key: {{ .Values.admin.secretKey }}
{{- if and .Values.redis.external.existingSecret (not .Values.redis.external.url) }}
- name: KVROUTE_INDEX__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.secretKey }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by the kvroute pods */}}
{{- define "kvroute.podSpecCommon" -}}
serviceAccountName: {{ include "kvroute.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.discovery.kubernetes.enabled }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "kvroute.volumeMounts" -}}
- name: config
  mountPath: /etc/kvroute
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "kvroute.volumes" -}}
- name: config
  configMap:
    name: {{ include "kvroute.fullname" . }}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
{{- end -}}
