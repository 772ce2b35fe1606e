/*
 * What the NVML stand-in's parts share (nvml_standin.c: the library and the machine; nvml_standin_mig.c:
 * MIG). The types and layouts are NVML's published ABI (nvml.h), written out here.
 */
#ifndef NVML_STANDIN_H
#define NVML_STANDIN_H

#include <limits.h>

#define EXPORT __attribute__((visibility("default")))

/* nvmlReturn_t */
typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32

#define MAX_GPUS 16
#define UNSUPPORTED INT_MIN

struct gpu {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
    unsigned int minor;
    unsigned long long memory_total;
    int brand;
    unsigned int architecture;
    int cc_major, cc_minor;      /* UNSUPPORTED: NOT_SUPPORTED */
    int mig_current, mig_pending; /* UNSUPPORTED: not MIG capable */
    int numa_node;               /* UNSUPPORTED: NOT_SUPPORTED */
    int mig_table;               /* 0: none; 1: the H100 80GB's (mig_profiles h100-80gb) */
    int listed;                  /* listed by this initialization: driven by the NVIDIA driver */
};

/* nvmlDevice_t is a pointer to an opaque struct: here, to one of these. */
typedef struct gpu *nvmlDevice_t;

extern struct gpu gpus[MAX_GPUS];
extern unsigned int gpu_count;

/* Whether the library is initialized. */
int initialized(void);
/* A descriptor holding GPU `g` open (its node under $NVML_STANDIN_DEV), or -1. */
int open_gpu(const struct gpu *g);
/* The GPU behind a handle, checked (initialized, one of ours, listed, its faults): *ret says why not. */
struct gpu *gpu_of(nvmlDevice_t device, const char *function, nvmlReturn_t *ret, int *garble);

#define GPU_OR_RETURN(g, device)                                   \
    nvmlReturn_t ret_;                                             \
    struct gpu *g = gpu_of(device, __func__, &ret_, NULL);         \
    if (!g)                                                        \
        return ret_;

/* MIG (nvml_standin_mig.c): a MIG device handle's UUID (NULL: not a MIG device handle), and the
 * state of a GPU forgotten (its instances go when the library is initialized afresh). */
const char *mig_uuid_of(nvmlDevice_t device);
void mig_reset(unsigned int index);

#endif
