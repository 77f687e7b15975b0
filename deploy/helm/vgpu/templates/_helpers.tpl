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
