{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "weir.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release already contains the chart name. */}}
{{- define "weir.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "weir.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries; pass a dict with "ctx" (the root) and "component". */}}
{{- define "weir.labels" -}}
helm.sh/chart: {{ include "weir.chart" .ctx }}
{{ include "weir.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: weir
{{- end }}

{{- define "weir.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weir.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "weir.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The Secret holding the Redis URL under key `url`. */}}
{{- define "weir.redisSecret" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- printf "%s-redis" (include "weir.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Redis password: the value, else the one already installed, else a new one. */}}
{{- define "weir.redisPassword" -}}
{{- if .Values.redis.password }}
{{- .Values.redis.password }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "weir.redisSecret" .) }}
{{- if and $existing (index $existing.data "password") }}
{{- index $existing.data "password" | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "weir.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "weir.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* The Secret holding the sidecars' admin token under key `token`. */}}
{{- define "weir.sidecarAdminSecret" -}}
{{- .Values.operator.sidecarAdminTokenSecret | default (printf "%s-sidecar-admin" (include "weir.fullname" .)) }}
{{- end }}

{{/* What the operator does in the namespaces it watches: a ClusterRole's rules when it
watches them all, a Role's in each one listed in operator.watchNamespaces. */}}
{{- define "weir.operatorRules" -}}
# kopf lists and watches pools, and patches their finalizer and its annotations.
- apiGroups: [inference.weir.dev]
  resources: [inferencepools]
  verbs: [list, watch, patch]
- apiGroups: [inference.weir.dev]
  resources: [inferencepools/status]
  verbs: [patch]
# Children name their pool as owner with blockOwnerDeletion, which clusters running the
# OwnerReferencesPermissionEnforcement admission plugin allow only to this right.
- apiGroups: [inference.weir.dev]
  resources: [inferencepools/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch]
# A drain lists the pool's pods and marks its victims' deletion cost.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* Labels of the engine pods the operator creates (in any namespace). */}}
{{- define "weir.engineLabels" -}}
app.kubernetes.io/managed-by: weir-operator
app.kubernetes.io/component: engine
{{- end }}

{{/* Namespaces where pools run, as a JSON list: the release namespace and every one that
gets the Redis Secret or is watched. */}}
{{- define "weir.poolNamespaces" -}}
{{- concat (list .Release.Namespace) .Values.redis.secretNamespaces .Values.operator.watchNamespaces | uniq | toJson }}
{{- end }}

{{/* A namespaceSelector for where engines may run: the listed namespaces when the
operator watches a list, any namespace when it watches them all. */}}
{{- define "weir.poolNamespaceSelector" -}}
{{- if .Values.operator.watchNamespaces -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: In
    values:
      {{- include "weir.poolNamespaces" . | fromJsonArray | toYaml | nindent 6 }}
{{- else -}}
{}
{{- end }}
{{- end }}

{{/* Egress rules to Redis: the chart's StatefulSet, or the rules given for an external one. */}}
{{- define "weir.redisEgress" -}}
{{- if .Values.redis.enabled -}}
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ .Release.Namespace }}
      podSelector:
        matchLabels:
          {{- include "weir.selectorLabels" (dict "ctx" . "component" "redis") | nindent 10 }}
  ports:
    - port: 6379
      protocol: TCP
{{- else }}
{{- toYaml .Values.networkPolicy.egress.externalRedis }}
{{- end }}
{{- end }}

{{/* Egress rule to the cluster's DNS. */}}
{{- define "weir.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.egress.dns | nindent 4 }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}
