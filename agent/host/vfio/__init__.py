"""VFIO passthrough of PCI functions, on a real host and on the simulated machine alike.

- `pci`: what sysfs says about a function (driver, override, IOMMU group and its members) and
  whether its group can be passed through (`passthrough_set`).
- `bind`: binding to vfio-pci and back as explicit, idempotent steps (`BindPlan`, `apply_step`), so
  the prepare engine can record each one durably before it takes effect.
- `inuse`: whether a GPU is free to leave its host driver (open handles, SR-IOV VFs).
- `nodes`: the VFIO device nodes a container (QEMU in virt-launcher) needs.

Every function takes the sysfs (and /proc, /dev) root as a setting. The writes are blocking and may
wait (bounded) for the kernel: call them off the event loop.
"""
