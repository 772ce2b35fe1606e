"""dra-agent: a Kubernetes DRA node agent for GPUs, NICs, CPU and memory."""

__version__ = "0.1.0"
