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

{{/* Whether the extender serves HTTPS (on its securePort): a given
certificate, or the webhook's. */}}
{{- define "vgpu.extenderTLS" -}}
{{- if or .Values.scheduler.extender.tls.secretName .Values.scheduler.webhook.enabled -}}true{{- end -}}
{{- end -}}

{{/* The service port on which API servers reach the extender's webhooks
(admission and Elastic GPU conversion). */}}
{{- define "vgpu.webhookPort" -}}
{{- .Values.scheduler.extender.securePort -}}
{{- end -}}

{{/* The secret holding the extender's certificate (also the name of the
cert-manager Certificate that fills it, when cert-manager issues it). */}}
{{- define "vgpu.extenderTLSSecret" -}}
{{- .Values.scheduler.extender.tls.secretName | default (printf "%s-scheduler-tls" (include "vgpu.fullname" .)) -}}
{{- end -}}

{{/*
The extender's certificate material, as JSON: caBundle (base64 PEM of the CA
that API servers trust when calling the extender: the admission webhook and
the Elastic GPU conversion webhook), and, where the chart makes the secret
itself (webhook on, no scheduler.extender.tls.secretName), crt and key with
chartSecret true; with certManager true (scheduler.webhook.certificate.certManager.issuer)
cert-manager issues it and its CA injector sets the caBundle. The chart's own CA is reused from an earlier install's
secret, so an upgrade does not leave running extenders with a certificate the
API server no longer trusts; otherwise a new one is made. genCA gives a new
CA on every call, so the first result is kept in a private key of .Values
(one map shared by every template of the release) and every caller gets that
same CA.
*/}}
{{- define "vgpu.extenderCerts" -}}
{{- if not (hasKey .Values "__vgpuExtenderCerts") -}}
{{- $certs := dict "caBundle" (.Values.scheduler.webhook.caBundle | default "") "crt" "" "key" "" "chartSecret" false "certManager" false -}}
{{- $certManager := .Values.scheduler.webhook.certificate.certManager.issuer -}}
{{- if and $certManager .Values.scheduler.extender.tls.secretName -}}
{{- fail "scheduler.webhook.certificate.certManager.issuer and scheduler.extender.tls.secretName: give one (cert-manager writes the chart's Secret; secretName names a Secret you keep)" -}}
{{- end -}}
{{- if and $certManager .Values.scheduler.webhook.caBundle -}}
{{- fail "scheduler.webhook.caBundle with scheduler.webhook.certificate.certManager.issuer: cert-manager's CA injector sets the webhooks' CA; leave caBundle empty" -}}
{{- end -}}
{{- $settings := .Values.scheduler.webhook.certificate -}}
{{- if and .Values.scheduler.webhook.enabled (not .Values.scheduler.extender.tls.secretName) (ge (int $settings.renewBeforeDays) (int $settings.days)) -}}
{{- fail (printf "scheduler.webhook.certificate.renewBeforeDays (%d) must be less than days (%d): every upgrade would issue a new certificate" (int $settings.renewBeforeDays) (int $settings.days)) -}}
{{- end -}}
{{- if and $certManager .Values.scheduler.webhook.enabled -}}
{{- $_ := set $certs "certManager" true -}}
{{- else if and .Values.scheduler.webhook.enabled (not .Values.scheduler.extender.tls.secretName) -}}
{{- $service := printf "%s-scheduler" (include "vgpu.fullname" .) -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "vgpu.extenderTLSSecret" .) -}}
{{- $existingData := (and $existing $existing.data) | default dict -}}
{{- $settings := .Values.scheduler.webhook.certificate -}}
{{- $days := int $settings.days -}}
{{- $renewBefore := int $settings.renewBeforeDays -}}
{{- $names := list $service (printf "%s.%s" $service .Release.Namespace) (printf "%s.%s.svc" $service .Release.Namespace) "localhost" -}}
{{- /* When the certificate issued now is due for renewal: an upgrade from
     then on issues the next (RFC 3339, in the Secret's annotation). */ -}}
{{- $renewAfter := now | dateModify (printf "+%dh" (mul 24 (sub $days $renewBefore))) | date "2006-01-02T15:04:05Z07:00" -}}
{{- if index $existingData "ca.crt" -}}
{{- $_ := set $certs "caBundle" (index $existingData "ca.crt") -}}
{{- $_ := set $certs "caKey" (index $existingData "ca.key" | default "") -}}
{{- $_ := set $certs "crt" (index $existingData "tls.crt") -}}
{{- $_ := set $certs "key" (index $existingData "tls.key") -}}
{{- $previous := index ($existing.metadata.annotations | default dict) "vgpu.io/renew-after" | default "" -}}
{{- $_ := set $certs "renewAfter" $previous -}}
{{- /* A Secret of a chart before renewal has no CA key (and a 10-year
     certificate): kept as it is. */ -}}
{{- if and $certs.caKey (or (not $previous) (ge (now | unixEpoch | int64) (toDate "2006-01-02T15:04:05Z07:00" $previous | unixEpoch | int64))) -}}
{{- $ca := buildCustomCert $certs.caBundle $certs.caKey -}}
{{- $cert := genSignedCert $service (list "127.0.0.1") $names $days $ca -}}
{{- $_ := set $certs "crt" ($cert.Cert | b64enc) -}}
{{- $_ := set $certs "key" ($cert.Key | b64enc) -}}
{{- $_ := set $certs "renewAfter" $renewAfter -}}
{{- end -}}
{{- else -}}
{{- $ca := genCA (printf "%s-webhook-ca" (include "vgpu.fullname" .)) 3650 -}}
{{- $cert := genSignedCert $service (list "127.0.0.1") $names $days $ca -}}
{{- $_ := set $certs "caBundle" ($ca.Cert | b64enc) -}}
{{- $_ := set $certs "caKey" ($ca.Key | b64enc) -}}
{{- $_ := set $certs "crt" ($cert.Cert | b64enc) -}}
{{- $_ := set $certs "key" ($cert.Key | b64enc) -}}
{{- $_ := set $certs "renewAfter" $renewAfter -}}
{{- end -}}
{{- $_ := set $certs "chartSecret" true -}}
{{- end -}}
{{- $_ := set .Values "__vgpuExtenderCerts" $certs -}}
{{- end -}}
{{- index .Values "__vgpuExtenderCerts" | toJson -}}
{{- end -}}

{{/*
CEL, given (list <a container's CEL expression> <resource names>): whether
that container names one of the resources in its limits or requests.
*/}}
{{- define "vgpu.celContainerNames" -}}
{{- $c := index . 0 -}}
{{- $quoted := list -}}
{{- range index . 1 }}{{ $quoted = append $quoted (printf "'%s'" .) }}{{ end -}}
{{- $set := printf "[%s]" (join ", " $quoted) -}}
({{ $c }}.?resources.?limits.orValue({}).exists(k, k in {{ $set }}) || {{ $c }}.?resources.?requests.orValue({}).exists(k, k in {{ $set }}))
{{- end -}}

{{/*
CEL, given (list $ <a container's CEL expression>): whether the container
is given vGPUs, i.e. names the GPU count or an Elastic GPU resource (as
cluster/src/requests/parse.rs's asks_for_vgpu reads a container).
*/}}
{{- define "vgpu.celContainerGetsVgpus" -}}
{{- $r := (index . 0).Values.resources -}}
{{- include "vgpu.celContainerNames" (list (index . 1) (list $r.gpu $r.elasticMemory $r.elasticCores)) -}}
{{- end -}}

{{/*
Whether the API server itself admits plain vGPU pods (templates/pod-admission.yaml):
"true" or empty. scheduler.webhook.inProcess auto: where the cluster serves
MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.36+).
*/}}
{{- define "vgpu.inProcessAdmission" -}}
{{- $webhook := .Values.scheduler.webhook -}}
{{- $mode := toString $webhook.inProcess -}}
{{- $served := .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
{{- if $webhook.enabled -}}
{{- if eq $mode "true" -}}
{{- if not $served -}}
{{- fail "scheduler.webhook.inProcess=true: this cluster serves no MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.36+); use auto or false, and the webhook admits every vGPU pod" -}}
{{- end -}}
true
{{- else if and (eq $mode "auto") $served -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
What the API server's own admission of vGPU pods applies to
(templates/pod-admission.yaml): pods being created in the namespaces the
webhook serves, with a container or init container given vGPUs.
*/}}
{{- define "vgpu.podAdmissionScope" -}}
matchConstraints:
  resourceRules:
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [CREATE]
      resources: [pods]
  namespaceSelector:
    matchExpressions:
      - key: vgpu.io/webhook
        operator: NotIn
        values: [ignore]
      {{- with .Values.scheduler.webhook.ignoreNamespaces }}
      - key: kubernetes.io/metadata.name
        operator: NotIn
        values: {{ toJson . }}
      {{- end }}
matchConditions:
  - name: gets-vgpus
    expression: >-
      {{- include "vgpu.celPodGetsVgpus" . | nindent 6 }}
{{- end -}}

{{/*
CEL: whether the pod being created has a container or init container that
is given vGPUs.
*/}}
{{- define "vgpu.celPodGetsVgpus" -}}
object.spec.containers.exists(c, {{ include "vgpu.celContainerGetsVgpus" (list . "c") }})
|| object.spec.?initContainers.orValue([]).exists(c, {{ include "vgpu.celContainerGetsVgpus" (list . "c") }})
{{- end -}}

{{/*
CEL: whether the pod being created names no node and no scheduler (or the
default one): the vGPU pods whose scheduler admission sets.
*/}}
{{- define "vgpu.celUnscheduled" -}}
object.spec.?nodeName.orValue('') == ''
&& object.spec.?schedulerName.orValue('') in ['', 'default-scheduler']
{{- end -}}

{{/*
CEL: whether a pod being created needs the extender's own admission (the
webhook) when the API server admits plain vGPU pods itself: a container
asking for Elastic GPU resources (given their GPU count), an Elastic GPU
claim to look up, KubeShare's labels or scheduler name to translate.
*/}}
{{- define "vgpu.needsExtenderAdmission" -}}
{{- $r := .Values.resources -}}
{{- $asks := include "vgpu.celContainerNames" (list "c" (list $r.elasticMemory $r.elasticCores)) -}}
object.spec.containers.exists(c, {{ $asks }}) || object.spec.?initContainers.orValue([]).exists(c, {{ $asks }}){{ if .Values.elasticGPU.crds.enabled }} || object.metadata.?annotations.orValue({}).exists(k, k.startsWith('egpuc.elasticgpu.io/')){{ end }} || object.metadata.?labels.orValue({}).exists(k, k.startsWith('sharedgpu/')){{ with .Values.scheduler.webhook.schedulerAlias }} || object.spec.?schedulerName.orValue('') == '{{ . }}'{{ end }}
{{- end -}}

{{/*
CEL: whether the admitted pod names one of the vGPU resources in a
container's or init container's limits or requests.
*/}}
{{- define "vgpu.asksForVgpus" -}}
{{- $r := .Values.resources -}}
{{- $names := list $r.gpu $r.memory $r.memoryPercentage $r.cores $r.priority $r.elasticMemory $r.elasticCores -}}
{{- $asks := include "vgpu.celContainerNames" (list "c" $names) -}}
object.spec.containers.exists(c, {{ $asks }}) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, {{ $asks }})){{ if .Values.elasticGPU.crds.enabled }} || (has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith('egpuc.elasticgpu.io/'))){{ end }} || (has(object.metadata.labels) && object.metadata.labels.exists(k, k.startsWith('sharedgpu/'))){{ with .Values.scheduler.webhook.schedulerAlias }} || (has(object.spec.schedulerName) && object.spec.schedulerName == '{{ . }}'){{ end }}
{{- end -}}

{{- /* How the node agents read pods' requests, as the extender does: its
resource names and defaults. The device plugin refuses a decision that
grants more than its pod asks for; the monitor restores no more than that. */ -}}
{{- define "vgpu.requestReadingArgs" -}}
- --resource-name={{ .Values.resources.gpu }}
- --resource-memory={{ .Values.resources.memory }}
- --resource-memory-percentage={{ .Values.resources.memoryPercentage }}
- --resource-cores={{ .Values.resources.cores }}
- --resource-priority={{ .Values.resources.priority }}
- --resource-elastic-memory={{ .Values.resources.elasticMemory }}
- --resource-elastic-cores={{ .Values.resources.elasticCores }}
- --default-memory-mib={{ .Values.scheduler.extender.defaultMemoryMiB }}
- --default-cores={{ .Values.scheduler.extender.defaultCores }}
{{- end -}}

{{- /* The node monitor's container: the same on device-plugin nodes and on
DRA nodes. */ -}}
{{- define "vgpu.monitorContainer" -}}
{{- $plugin := .Values.node.devicePlugin -}}
{{- $monitor := .Values.node.monitor -}}
- name: monitor
  image: {{ include "vgpu.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [/usr/local/bin/vgpu-monitor]
  args:
    - --listen=0.0.0.0:{{ $monitor.port }}
    - --containers-dir=/host/vgpu/containers
    - --interval-ms={{ $monitor.intervalMs }}
    - --cleanup-grace-seconds={{ $monitor.cleanupGraceSeconds }}
    # What the plugin adds to every container's limits: the monitor
    # restores them, with the decision's, in a region changed from
    # inside.
    - --core-policy={{ $plugin.corePolicy }}
    {{- with $plugin.swapLimit }}
    - --swap-limit={{ . }}
    {{- end }}
    - --device-memory-scaling={{ $plugin.deviceMemoryScaling }}
    {{- include "vgpu.requestReadingArgs" . | nindent 4 }}
    {{- if not $monitor.arbitration }}
    - --no-arbitration
    {{- end }}
    {{- if $monitor.hamiMetricNames }}
    - --hami-metric-names
    {{- end }}
    # The backstop: a container whose processes hold more of a GPU than
    # its grant (as NVML counts it), or take more of its time than their
    # share while another container uses it, shim or not.
    - --over-cap-action={{ $monitor.overCapAction }}
    - --over-cap-margin={{ $monitor.overCapMargin }}
    - --over-share-tolerance={{ $monitor.overShareTolerance }}
    - --log-level={{ $monitor.logLevel }}
  env:
    - name: NODE_NAME
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    - name: NVIDIA_VISIBLE_DEVICES
      value: all
    - name: NVIDIA_DRIVER_CAPABILITIES
      value: utility
  ports:
    - name: metrics
      containerPort: {{ $monitor.port }}
      {{- if $monitor.hostPort }}
      hostPort: {{ $monitor.port }}
      {{- end }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /healthz
      port: metrics
    periodSeconds: 10
  livenessProbe:
    httpGet:
      path: /healthz
      port: metrics
    initialDelaySeconds: 10
    periodSeconds: 30
  securityContext:
    allowPrivilegeEscalation: false
    capabilities:
      drop: [ALL]
      {{- if eq $monitor.overCapAction "kill" }}
      # To kill, in the host's PID namespace, a container's process that
      # holds more of a GPU than the container's grant (processes of other
      # users too).
      add: [KILL]
      {{- end }}
  resources:
    {{- toYaml $monitor.resources | nindent 12 }}
  volumeMounts:
    - name: vgpu-host
      mountPath: /host/vgpu
    # Every GPU, for a toolkit that reads them from mounts only.
    - name: all-gpus
      mountPath: /var/run/nvidia-container-devices/all
      readOnly: true
{{- end }}
