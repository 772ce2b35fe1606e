"""The names GPU discovery publishes for NVML's brand and architecture codes (`brand`,
`architecture` attributes of a GPU and of its forms)."""

from __future__ import annotations

import pynvml

BRANDS = {
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "GRID",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NVIDIA Virtual Applications",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NVIDIA Virtual PC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NVIDIA Virtual Compute Server",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NVIDIA RTX Virtual Workstation",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NVIDIA Cloud Gaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "Quadro RTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NVIDIA RTX",
    pynvml.NVML_BRAND_NVIDIA: "NVIDIA",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForce RTX",
    pynvml.NVML_BRAND_TITAN_RTX: "Titan RTX",
}
ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
}
# Codes that say NVML does not know either: the attribute is omitted.
NO_BRAND = pynvml.NVML_BRAND_UNKNOWN
NO_ARCHITECTURE = pynvml.NVML_DEVICE_ARCH_UNKNOWN
