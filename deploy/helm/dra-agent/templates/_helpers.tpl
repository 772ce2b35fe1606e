{{/*
The labels every object carries: deploy/base's (its kustomization's `labels`). No Helm labels: the
default render is deploy/base, object for object (tests/test_helm.py); Helm finds its objects by the
release annotations it adds itself.
*/}}
{{- define "dra-agent.labels" -}}
app.kubernetes.io/part-of: dra-agent
{{- end }}

{{/* The service account's user name, as the admission policies match it. */}}
{{- define "dra-agent.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:dra-agent
{{- end }}

{{/*
Simulated GPUs (settings.nvml sim[:PROFILE]): nothing opens a GPU, so no host /dev, no driver root, no
host PID namespace, and an unprivileged container (deploy/overlays/dev).
*/}}
{{- define "dra-agent.simulated" -}}
{{- if hasPrefix "sim" (toString .Values.settings.nvml) }}true{{ end }}
{{- end }}

{{/*
A DeviceClass selector: the driver's devices of one `type` attribute, then `more` (an expression
joined with &&, or ""). Rendered on one line, as deploy/base's folded expressions are.
*/}}
{{- define "dra-agent.selector" -}}
device.driver == '{{ .driver }}' && has(device.attributes[device.driver].type) && device.attributes[device.driver].type == '{{ .type }}'
{{- with .more }} && {{ . }}{{ end }}
{{- end }}

{{/*
One DeviceClass: name (given the ".<driver>" suffix unless `fullName`), the selector's type and
extra expression, the extended resource name and the selectors after the first.
*/}}
{{- define "dra-agent.deviceclass" -}}
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: {{ .fullName | default (printf "%s.%s" .name .driver) }}
  labels:
    {{- include "dra-agent.labels" . | nindent 4 }}
spec:
  selectors:
  - cel:
      expression: {{ include "dra-agent.selector" . | quote }}
  {{- range .extraSelectors }}
  - cel:
      expression: {{ . | quote }}
  {{- end }}
  {{- with .extendedResourceName }}
  extendedResourceName: {{ . }}
  {{- end }}
{{- end }}
