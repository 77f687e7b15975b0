{{/* Names and labels shared by every object of a release. */}}

{{- define "vgpu.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vgpu.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vgpu.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "vgpu.kubeSchedulerImage" -}}
{{- $tag := .Values.scheduler.kubeScheduler.image.tag | default (regexReplaceAll "\\+.*$" .Capabilities.KubeVersion.Version "") -}}
{{- printf "%s:%s" .Values.scheduler.kubeScheduler.image.repository $tag -}}
{{- end -}}

{{/* The directory holding one directory per container (regions). */}}
{{- define "vgpu.containersDir" -}}
{{- printf "%s/containers" (.Values.hostDir | trimSuffix "/") -}}
{{- end -}}

{{/* Whether the extender serves HTTPS: a given certificate, or the webhook's. */}}
{{- define "vgpu.extenderTLS" -}}
{{- if or .Values.scheduler.extender.tls.secretName .Values.scheduler.webhook.enabled -}}true{{- end -}}
{{- end -}}

{{/* The secret holding the extender's certificate. */}}
{{- define "vgpu.extenderTLSSecret" -}}
{{- .Values.scheduler.extender.tls.secretName | default (printf "%s-scheduler-tls" (include "vgpu.fullname" .)) -}}
{{- end -}}

{{/*
CEL: whether the admitted pod names one of the vGPU resources in a
container's or init container's limits or requests.
*/}}
{{- define "vgpu.asksForVgpus" -}}
{{- $r := .Values.resources -}}
{{- $names := list $r.gpu $r.memory $r.memoryPercentage $r.cores $r.priority $r.elasticMemory $r.elasticCores -}}
{{- $quoted := list -}}
{{- range $names }}{{ $quoted = append $quoted (printf "'%s'" .) }}{{ end -}}
{{- $set := printf "[%s]" (join ", " $quoted) -}}
{{- $asks := printf "has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k in %s)) || (has(c.resources.requests) && c.resources.requests.exists(k, k in %s)))" $set $set -}}
object.spec.containers.exists(c, {{ $asks }}) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, {{ $asks }}))
{{- end -}}
