/*
 * A stand-in for the NVIDIA driver's libnvidia-ml.so.1, for tests: the real `pynvml`
 * loads it with ctypes exactly as it loads the driver's library, so discovery runs its
 * real NVML code path (symbol lookup, handles as pointers, structure layouts, versioned
 * functions, return codes turned into exceptions) on a machine without a GPU.
 *
 * It exports the NVML functions the agent calls (and that pynvml looks up for them) and
 * answers for the machine described in a small text file (machine.txt, format below):
 *   - $NVML_STANDIN_MACHINE, else machine.txt next to this library;
 *   - read again by an nvmlInitWithFlags when the library is not initialized.
 * Faults are switched on and off while a process runs through a control file,
 * $NVML_STANDIN_CONTROL, read again on every call about a GPU (a missing file: no faults):
 *   lost INDEX                      every call about that GPU answers NVML_ERROR_GPU_IS_LOST
 *   error INDEX FUNCTION CODE       FUNCTION (the C symbol: nvmlDeviceGetPciInfo_v3) answers
 *                                   CODE (a number) for that GPU
 *   garble INDEX                    the GPU's name comes back with bytes that are not UTF-8
 *   xid INDEX XID, dbe INDEX        an NVML event (XID critical error, double-bit ECC), delivered
 *                                   once to each event set registered for it (see "events" below)
 *   action INDEX CODE               the GPU's recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
 *   unloaded                        the NVIDIA driver is unloaded (its container reloading it):
 *                                   nvmlInit answers NVML_ERROR_DRIVER_NOT_LOADED, and a session
 *                                   opened before is over, every call of it answering
 *                                   NVML_ERROR_UNINITIALIZED, also once the line is gone, until
 *                                   the last nvmlShutdown and a new nvmlInit
 *
 * Built twice (see the Makefile): the current driver's library, and with -DSTANDIN_LEGACY
 * an older driver's, which lacks nvmlDeviceGetNumaNodeId and nvmlDeviceGetMemoryInfo_v2, so
 * that pynvml answers NVML_ERROR_FUNCTION_NOT_FOUND for them, as on a real older driver, and
 * answers NOT_SUPPORTED for the GPU recovery action field, which older drivers do not know.
 *
 * machine.txt: `key value` lines; `#` starts a comment; `gpu` starts the next GPU (in
 * NVML index order). Top level: driver_version TEXT, cuda_driver_version INT. Per GPU:
 * name, uuid, bus_id (as NVML spells it, 00000000:18:00.0), pci_device_id, pci_subsystem_id,
 * minor, memory_total (bytes), brand, architecture (the enum's numbers), and
 * compute_capability MAJOR MINOR, mig_mode CURRENT PENDING, numa_node N, each of which may
 * instead be `not_supported`; mig_profiles h100-80gb for a GPU with MIG profiles (the MIG calls
 * are in nvml_standin_mig.c).
 *
 * The host, where a test gives it: $NVML_STANDIN_SYSFS (a GPU whose PCI function there is bound to
 * another driver than nvidia is not listed, see "what an initialized library sees and holds"),
 * $NVML_STANDIN_DEV (a handle holds the GPU's node there open) and $NVML_STANDIN_PROC (the driver's
 * MIG capability files).
 *
 * The types and layouts below are NVML's published ABI (nvml.h), written out here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <strings.h>
#include <unistd.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml_standin.h"

/* Buffer sizes (the _V2 sizes pynvml passes). */
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

/* nvmlPciInfo_t as filled by nvmlDeviceGetPciInfo_v3: 68 bytes. */
typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;    /* (device << 16) | vendor */
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

/* nvmlMemory_t (nvmlDeviceGetMemoryInfo): 24 bytes. */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* nvmlMemory_v2_t (nvmlDeviceGetMemoryInfo_v2): 40 bytes, version = size | 2 << 24. */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t is 68 bytes");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t is 24 bytes");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t is 40 bytes");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2 is 0x02000028");

/* -- the machine ---------------------------------------------------------------------------- */

/* nvmlDevice_t is a pointer to an opaque struct: here, to one of these (`struct gpu`, nvml_standin.h). */
struct gpu gpus[MAX_GPUS];
unsigned int gpu_count;
static char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
static int cuda_driver_version;
static int refcount;

static void complain(const char *file, int line, const char *what) {
    fprintf(stderr, "nvml stand-in: %s:%d: %s\n", file, line, what);
}

static const char *machine_path(char *buf, size_t size) {
    const char *env = getenv("NVML_STANDIN_MACHINE");
    if (env && *env)
        return env;
    Dl_info info;
    if (!dladdr((void *)machine_path, &info) || !info.dli_fname)
        return NULL;
    const char *slash = strrchr(info.dli_fname, '/');
    int dir = slash ? (int)(slash - info.dli_fname) : 1;
    snprintf(buf, size, "%.*s/machine.txt", dir, slash ? info.dli_fname : ".");
    return buf;
}

static int copy_text(char *dst, size_t size, const char *src) {
    if (strlen(src) >= size)
        return -1;
    strcpy(dst, src);
    return 0;
}

static int pair_or_unsupported(const char *value, int *a, int *b) {
    if (strcmp(value, "not_supported") == 0) {
        *a = *b = UNSUPPORTED;
        return 0;
    }
    return sscanf(value, "%d %d", a, b) == 2 ? 0 : -1;
}

static int parse_bus_id(struct gpu *g) {
    unsigned int function;
    char extra;
    if (sscanf(g->bus_id, "%x:%x:%x.%x%c", &g->domain, &g->bus, &g->device, &function, &extra) != 4)
        return -1;
    return 0;
}

static int load_machine(void) {
    char buf[PATH_MAX];
    const char *path = machine_path(buf, sizeof buf);
    if (!path) {
        complain("?", 0, "cannot find machine.txt (set NVML_STANDIN_MACHINE)");
        return -1;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        complain(path, 0, strerror(errno));
        return -1;
    }
    memset(gpus, 0, sizeof gpus);
    gpu_count = 0;
    driver_version[0] = 0;
    cuda_driver_version = 0;
    struct gpu *g = NULL;
    char line[512];
    int lineno = 0, bad = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char *end = line + strlen(line);
        while (end > line && (end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
            *--end = 0;
        char *key = line + strspn(line, " \t");
        if (!*key)
            continue;
        char *value = key + strcspn(key, " \t");
        if (*value) {
            *value++ = 0;
            value += strspn(value, " \t");
        }
        if (strcmp(key, "gpu") == 0) {
            if (gpu_count == MAX_GPUS) {
                complain(path, lineno, "too many GPUs");
                bad = 1;
                break;
            }
            g = &gpus[gpu_count++];
            g->architecture = 0xffffffffu; /* NVML_DEVICE_ARCH_UNKNOWN */
            g->cc_major = g->cc_minor = g->mig_current = g->mig_pending = g->numa_node = UNSUPPORTED;
            continue;
        }
        int ok = 0;
        if (strcmp(key, "driver_version") == 0) {
            ok = copy_text(driver_version, sizeof driver_version, value) == 0;
        } else if (strcmp(key, "cuda_driver_version") == 0) {
            ok = sscanf(value, "%d", &cuda_driver_version) == 1;
        } else if (!g) {
            ok = 0;
        } else if (strcmp(key, "name") == 0) {
            ok = copy_text(g->name, sizeof g->name, value) == 0;
        } else if (strcmp(key, "uuid") == 0) {
            ok = copy_text(g->uuid, sizeof g->uuid, value) == 0;
        } else if (strcmp(key, "bus_id") == 0) {
            ok = copy_text(g->bus_id, sizeof g->bus_id, value) == 0 && parse_bus_id(g) == 0;
        } else if (strcmp(key, "pci_device_id") == 0) {
            ok = sscanf(value, "%x", &g->pci_device_id) == 1;
        } else if (strcmp(key, "pci_subsystem_id") == 0) {
            ok = sscanf(value, "%x", &g->pci_subsystem_id) == 1;
        } else if (strcmp(key, "minor") == 0) {
            ok = sscanf(value, "%u", &g->minor) == 1;
        } else if (strcmp(key, "memory_total") == 0) {
            ok = sscanf(value, "%llu", &g->memory_total) == 1;
        } else if (strcmp(key, "brand") == 0) {
            ok = sscanf(value, "%d", &g->brand) == 1;
        } else if (strcmp(key, "architecture") == 0) {
            ok = sscanf(value, "%u", &g->architecture) == 1;
        } else if (strcmp(key, "compute_capability") == 0) {
            ok = pair_or_unsupported(value, &g->cc_major, &g->cc_minor) == 0;
        } else if (strcmp(key, "mig_mode") == 0) {
            ok = pair_or_unsupported(value, &g->mig_current, &g->mig_pending) == 0;
        } else if (strcmp(key, "mig_profiles") == 0) {
            ok = strcmp(value, "h100-80gb") == 0 && (g->mig_table = 1);
        } else if (strcmp(key, "numa_node") == 0) {
            ok = strcmp(value, "not_supported") == 0 ? (g->numa_node = UNSUPPORTED, 1)
                                                     : sscanf(value, "%d", &g->numa_node) == 1;
        }
        if (!ok) {
            complain(path, lineno, "unknown key, misplaced key or bad value");
            bad = 1;
        }
    }
    fclose(f);
    for (unsigned int i = 0; !bad && i < gpu_count; i++) {
        if (!gpus[i].name[0] || !gpus[i].uuid[0] || !gpus[i].bus_id[0]) {
            complain(path, 0, "every gpu needs name, uuid and bus_id");
            bad = 1;
        }
    }
    return bad ? -1 : 0;
}

/* -- faults ---------------------------------------------------------------------------------- */

/* What the control file says about `function` on GPU `index`: an error code (returned), a
 * garbled name (*garble set), or nothing (NVML_SUCCESS). */
static nvmlReturn_t fault(unsigned int index, const char *function, int *garble) {
    const char *path = getenv("NVML_STANDIN_CONTROL");
    if (garble)
        *garble = 0;
    if (!path || !*path)
        return NVML_SUCCESS;
    FILE *f = fopen(path, "r");
    if (!f)
        return NVML_SUCCESS;
    char line[256], word[32], fn[128];
    unsigned int at;
    int code;
    nvmlReturn_t ret = NVML_SUCCESS;
    while (ret == NVML_SUCCESS && fgets(line, sizeof line, f)) {
        if (sscanf(line, "%31s %u", word, &at) != 2 || at != index)
            continue;
        if (strcmp(word, "lost") == 0)
            ret = NVML_ERROR_GPU_IS_LOST;
        else if (strcmp(word, "error") == 0 && sscanf(line, "%*s %*u %127s %d", fn, &code) == 2 &&
                 strcmp(fn, function) == 0)
            ret = code;
        else if (strcmp(word, "garble") == 0 && garble)
            *garble = 1;
    }
    fclose(f);
    return ret;
}

/* Whether the control file says `unloaded`: the driver is gone. */
static int unloaded(void) {
    const char *path = getenv("NVML_STANDIN_CONTROL");
    if (!path || !*path)
        return 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[256], word[32];
    int found = 0;
    while (!found && fgets(line, sizeof line, f))
        found = sscanf(line, "%31s", word) == 1 && strcmp(word, "unloaded") == 0;
    fclose(f);
    return found;
}

/* The driver was unloaded under the current session: its handles and event sets mean nothing now. */
static int session_over;

int initialized(void) {
    if (__atomic_load_n(&refcount, __ATOMIC_SEQ_CST) <= 0)
        return 0;
    if (unloaded())
        __atomic_store_n(&session_over, 1, __ATOMIC_SEQ_CST);
    return !__atomic_load_n(&session_over, __ATOMIC_SEQ_CST);
}

/* The GPU behind a handle, checked: *ret says why not. A GPU this initialization does not list (it
 * left the NVIDIA driver) has no valid handle. */
struct gpu *gpu_of(nvmlDevice_t device, const char *function, nvmlReturn_t *ret, int *garble) {
    if (!initialized()) {
        *ret = NVML_ERROR_UNINITIALIZED;
        return NULL;
    }
    uintptr_t at = (uintptr_t)device, first = (uintptr_t)gpus;
    if (at < first || at >= first + gpu_count * sizeof *gpus || (at - first) % sizeof *gpus || !device->listed) {
        *ret = NVML_ERROR_INVALID_ARGUMENT;
        return NULL;
    }
    *ret = fault((unsigned int)(device - gpus), function, garble);
    return *ret == NVML_SUCCESS ? device : NULL;
}

/* -- what an initialized library sees and holds ----------------------------------------------- */
/*
 * Two facts of the real library. It lists the GPUs the NVIDIA driver drives when it is initialized,
 * numbered in that order: with $NVML_STANDIN_SYSFS set, a GPU whose PCI function there
 * (bus/pci/devices/<bus id>) is bound to another driver, or to none, is not listed, and the GPUs after
 * it move down an index (the control file's INDEX stays a GPU's place in machine.txt). And a handle
 * holds its GPU open: with $NVML_STANDIN_DEV set, the first handle of a GPU opens <dev>/nvidia<minor>
 * (O_PATH: a test's node has no driver behind it) until the last nvmlShutdown, and an event registration
 * holds it too until its set is freed, so /proc shows this process with the GPU open, as with the real
 * library.
 */

static unsigned int listed[MAX_GPUS], listed_count;
static int held[MAX_GPUS] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

static int driven(const struct gpu *g) {
    const char *sysfs = getenv("NVML_STANDIN_SYSFS");
    if (!sysfs || !*sysfs)
        return 1;
    char path[PATH_MAX], target[PATH_MAX];
    snprintf(path, sizeof path, "%s/bus/pci/devices/%04x:%02x:%02x.0", sysfs, g->domain, g->bus, g->device);
    if (access(path, F_OK) != 0)
        return 1; /* not in that sysfs: nothing says it left the driver */
    strncat(path, "/driver", sizeof path - strlen(path) - 1);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0)
        return 0; /* unbound */
    target[n] = 0;
    const char *base = strrchr(target, '/');
    return strcmp(base ? base + 1 : target, "nvidia") == 0;
}

static void enumerate(void) {
    listed_count = 0;
    for (unsigned int i = 0; i < gpu_count; i++) {
        gpus[i].listed = driven(&gpus[i]);
        if (gpus[i].listed)
            listed[listed_count++] = i;
    }
}

int open_gpu(const struct gpu *g) {
    const char *dev = getenv("NVML_STANDIN_DEV");
    if (!dev || !*dev)
        return -1;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/nvidia%u", dev, g->minor);
    return open(path, O_PATH | O_CLOEXEC);
}

static void hold(struct gpu *g) {
    unsigned int i = (unsigned int)(g - gpus);
    if (held[i] < 0)
        held[i] = open_gpu(g);
}

static void let_go_all(void) {
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        if (held[i] >= 0)
            close(held[i]);
        held[i] = -1;
    }
}

static nvmlReturn_t put_text(char *dst, unsigned int length, const char *src) {
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* -- library lifetime ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    /* The machine is read, and its GPUs listed, by the first initialization (not under a caller that
     * holds handles); MIG instances of an earlier one are gone with it. */
    if (unloaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (__atomic_load_n(&refcount, __ATOMIC_SEQ_CST) <= 0) {
        if (load_machine() != 0)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        __atomic_store_n(&session_over, 0, __ATOMIC_SEQ_CST);
        enumerate();
        for (unsigned int i = 0; i < gpu_count; i++)
            mig_reset(i);
    }
    __atomic_add_fetch(&refcount, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    if (__atomic_load_n(&refcount, __ATOMIC_SEQ_CST) <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (__atomic_sub_fetch(&refcount, 1, __ATOMIC_SEQ_CST) == 0)
        let_go_all();
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version Mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    default: return "Unknown Error";
    }
}

/* -- system queries -------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return put_text(version, length, driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = cuda_driver_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = listed_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (index >= listed_count || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = fault(listed[index], __func__, NULL);
    if (ret != NVML_SUCCESS)
        return ret;
    *device = &gpus[listed[index]];
    hold(*device);
    return NVML_SUCCESS;
}

/* The listed GPU whose UUID (`by_uuid`) or bus ID (any case) is `value`, held. */
static nvmlReturn_t handle_where(int by_uuid, const char *value, nvmlDevice_t *device, const char *function) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!value || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int n = 0; n < listed_count; n++) {
        struct gpu *g = &gpus[listed[n]];
        if (by_uuid ? strcmp(g->uuid, value) != 0 : strcasecmp(g->bus_id, value) != 0)
            continue;
        nvmlReturn_t ret = fault(listed[n], function, NULL);
        if (ret != NVML_SUCCESS)
            return ret;
        *device = g;
        hold(g);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    return handle_where(1, uuid, device, __func__);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    /* Either spelling of the domain: 0000:18:00.0 or 00000000:18:00.0. */
    char full[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    snprintf(full, sizeof full, "%s%s", pciBusId && strlen(pciBusId) == 12 ? "0000" : "", pciBusId ? pciBusId : "");
    return handle_where(0, pciBusId ? full : NULL, device, __func__);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    GPU_OR_RETURN(g, device);
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int n = 0; n < listed_count; n++)
        if (&gpus[listed[n]] == g)
            *index = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    GPU_OR_RETURN(g, device);
    (void)g;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = 0; /* NVML_FEATURE_DISABLED: no nvidia-persistenced here */
    return NVML_SUCCESS;
}

/* -- per-GPU queries ------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t ret;
    int garble;
    struct gpu *g = gpu_of(device, __func__, &ret, &garble);
    if (!g)
        return ret;
    if (garble) {
        /* A name in Latin-1, as a corrupted or foreign VBIOS string might read: not UTF-8. */
        char bytes[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        snprintf(bytes, sizeof bytes, "%s \xff\xfe", g->name);
        return put_text(name, length, bytes);
    }
    return put_text(name, length, g->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    const char *mig = mig_uuid_of(device);
    if (mig)
        return put_text(uuid, length, mig);
    GPU_OR_RETURN(g, device);
    return put_text(uuid, length, g->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    GPU_OR_RETURN(g, device);
    if (!minorNumber)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = g->minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    GPU_OR_RETURN(g, device);
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", g->domain, g->bus, g->device);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    GPU_OR_RETURN(g, device);
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* What a v1 caller sees on a current driver: `used` includes the driver's reservation. */
    unsigned long long reserved = g->memory_total / 64;
    memory->total = g->memory_total;
    memory->used = reserved;
    memory->free = g->memory_total - reserved;
    return NVML_SUCCESS;
}

#ifndef STANDIN_LEGACY
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    GPU_OR_RETURN(g, device);
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long reserved = g->memory_total / 64;
    memory->total = g->memory_total;
    memory->reserved = reserved;
    memory->used = 0;
    memory->free = g->memory_total - reserved;
    return NVML_SUCCESS;
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type) {
    GPU_OR_RETURN(g, device);
    if (!type)
        return NVML_ERROR_INVALID_ARGUMENT;
    *type = g->brand;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    GPU_OR_RETURN(g, device);
    if (!arch)
        return NVML_ERROR_INVALID_ARGUMENT;
    *arch = g->architecture;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    GPU_OR_RETURN(g, device);
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->cc_major == UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    *major = g->cc_major;
    *minor = g->cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    GPU_OR_RETURN(g, device);
    if (!currentMode || !pendingMode)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->mig_current == UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = (unsigned int)g->mig_current;
    *pendingMode = (unsigned int)g->mig_pending;
    return NVML_SUCCESS;
}

#ifndef STANDIN_LEGACY
EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    GPU_OR_RETURN(g, device);
    if (!node)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->numa_node == UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)g->numa_node;
    return NVML_SUCCESS;
}
#endif

/* -- events and field values ----------------------------------------------------------------- */
/*
 * Events come from the control file too: `xid INDEX XID` and `dbe INDEX` lines are events in
 * the order they appear, each delivered once to every event set that was registered for that
 * GPU and type when the set reached it (a set remembers how many event lines it has passed).
 * `action INDEX CODE` sets the GPU's recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION);
 * the legacy build answers that field NOT_SUPPORTED, as a driver older than the field does.
 */

#define nvmlEventTypeDoubleBitEccError 0x0000000000000002ULL
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_VALUE_TYPE_UNSIGNED_INT 1

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    union { double d; unsigned int ui; unsigned long ul; unsigned long long ull; long long sll; int si; } value;
} nvmlFieldValue_t;

_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t is 32 bytes");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t is 40 bytes");

struct event_set {
    unsigned long long registered[MAX_GPUS];
    unsigned int passed; /* event lines of the control file already considered */
    int fds[MAX_GPUS];   /* a registration holds its GPU open until the set is freed */
};
typedef struct event_set *nvmlEventSet_t;

/* The n-th event line of the control file (0-based): 1 and its GPU, type and data, or 0. */
static int event_line(unsigned int n, unsigned int *index, unsigned long long *type, unsigned long long *data) {
    const char *path = getenv("NVML_STANDIN_CONTROL");
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (!f)
        return 0;
    char line[256], word[32];
    unsigned int at, xid, seen = 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        int fields = sscanf(line, "%31s %u %u", word, &at, &xid);
        int is_xid = fields == 3 && strcmp(word, "xid") == 0, is_dbe = fields >= 2 && strcmp(word, "dbe") == 0;
        if (!is_xid && !is_dbe)
            continue;
        if (seen++ == n) {
            *index = at;
            *type = is_xid ? nvmlEventTypeXidCriticalError : nvmlEventTypeDoubleBitEccError;
            *data = is_xid ? xid : 0;
            found = 1;
        }
    }
    fclose(f);
    return found;
}

#ifndef STANDIN_LEGACY
static unsigned int recovery_action(unsigned int index) {
    const char *path = getenv("NVML_STANDIN_CONTROL");
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    unsigned int action = 0, at, code;
    char line[256];
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "action %u %u", &at, &code) == 2 && at == index)
            action = code;
    fclose(f);
    return action;
}
#endif

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    if (!*set)
        return NVML_ERROR_UNKNOWN;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        (*set)->fds[i] = -1;
    /* Events written before the set existed are not its events. */
    unsigned int index;
    unsigned long long type, data;
    while (event_line((*set)->passed, &index, &type, &data))
        (*set)->passed++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        if (set->fds[i] >= 0)
            close(set->fds[i]);
    free(set);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    GPU_OR_RETURN(g, device);
    if (!eventTypes)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    GPU_OR_RETURN(g, device);
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~(nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError))
        return NVML_ERROR_NOT_SUPPORTED;
    set->registered[g - gpus] |= eventTypes;
    if (set->fds[g - gpus] < 0)
        set->fds[g - gpus] = open_gpu(g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (unsigned int waited = 0;; waited += 10) {
        unsigned int index;
        unsigned long long type, value;
        while (event_line(set->passed, &index, &type, &value)) {
            set->passed++;
            if (index < gpu_count && (set->registered[index] & type)) {
                memset(data, 0, sizeof *data);
                data->device = &gpus[index];
                data->eventType = type;
                data->eventData = value;
                data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
                return NVML_SUCCESS;
            }
        }
        if (waited >= timeoutms)
            return NVML_ERROR_TIMEOUT;
        nanosleep(&tick, NULL);
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    GPU_OR_RETURN(g, device);
    if (valuesCount < 0 || (valuesCount && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = 0;
        v->latencyUsec = 0;
#ifndef STANDIN_LEGACY
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->nvmlReturn = NVML_SUCCESS;
            v->value.ull = 0;
            v->value.ui = recovery_action((unsigned int)(g - gpus));
            continue;
        }
#endif
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}
