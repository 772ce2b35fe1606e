/*
 * The NVML stand-in's MIG: the calls the agent makes to read a GPU's MIG profiles and placements and
 * to create and destroy GPU and compute instances (agent/inventory/mig.py, agent/hostprep/mig.py),
 * with NVML's structure layouts, versioned structures, list conventions and return codes, and the
 * hardware's rules as NVML states them: an instance covers the memory slices of its placement, two
 * instances never share a slice, a profile has at most `instanceCount` instances (an overlap or one
 * too many is INSUFFICIENT_RESOURCES), creating needs MIG mode on (NOT_SUPPORTED), a GPU instance with
 * compute instances cannot be destroyed, nor MIG mode turned off with GPU instances (IN_USE).
 *
 * A GPU has MIG profiles when machine.txt gives it `mig_profiles h100-80gb`: the H100 80GB's table (the
 * facts agent/sim/migprofiles.py holds, from NVIDIA's MIG user guide). A MIG device's UUID is made
 * afresh (random) each time its compute instance is created, as the driver does: an instance destroyed
 * and made again at the same place is another MIG device. Instances live as long as this library's
 * initialization (real ones outlive the process; the tests here make and destroy them in one agent).
 *
 * The kernel module's side, where a test gives $NVML_STANDIN_PROC (the host's /proc): each GPU and
 * compute instance's access capability, `driver/nvidia/capabilities/gpu<minor>/mig/gi<id>/[ci<id>/]access`
 * (`DeviceFileMinor`, the minors the driver numbers as 3 + 135 * GPU minor + 9 * GI id (+ 1 + CI id)),
 * there while the instance exists. Device nodes for them are nobody's here, as with the real driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nvml_standin.h"

#define NAME_SIZE 96
#define MAX_GIS 8   /* a GPU has at most 7 GPU instances */
#define MAX_CIS 8   /* a GPU instance at most 8 compute instances */
#define MIG_ENABLE 1

typedef struct { unsigned int start, size; } nvmlGpuInstancePlacement_t;

typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount,
        decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NAME_SIZE];
} nvmlGpuInstanceProfileInfo_v2_t;
#define nvmlGpuInstanceProfileInfo_v2 ((unsigned int)(sizeof(nvmlGpuInstanceProfileInfo_v2_t) | (2u << 24)))

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[NAME_SIZE];
} nvmlComputeInstanceProfileInfo_v2_t;
#define nvmlComputeInstanceProfileInfo_v2 ((unsigned int)(sizeof(nvmlComputeInstanceProfileInfo_v2_t) | (2u << 24)))

struct gi;
struct ci;
typedef struct gi *nvmlGpuInstance_t;
typedef struct ci *nvmlComputeInstance_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 152, "nvmlGpuInstanceProfileInfo_v2_t is 152 bytes");
_Static_assert(nvmlGpuInstanceProfileInfo_v2 == 0x02000098, "nvmlGpuInstanceProfileInfo_v2 is 0x02000098");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v2_t) == 136, "nvmlComputeInstanceProfileInfo_v2_t is 136 bytes");
_Static_assert(sizeof(nvmlGpuInstanceInfo_t) == 24, "nvmlGpuInstanceInfo_t is 24 bytes");
_Static_assert(sizeof(nvmlComputeInstanceInfo_t) == 32, "nvmlComputeInstanceInfo_t is 32 bytes");

/* -- the H100 80GB's profiles ------------------------------------------------------------------ */

struct profile {
    unsigned int enumv, id;
    const char *name;
    unsigned int slices, instances, sms, copy, dec, enc, jpeg, ofa, memory_mib;
    unsigned int starts[8], nstarts, size;
};

static const struct profile H100_80GB[] = {
    {0, 19, "1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984, {0, 1, 2, 3, 4, 5, 6}, 7, 1},
    {7, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984, {0, 1, 2, 3, 4, 5, 6}, 7, 1},
    {9, 15, "1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096, {0, 2, 4, 6}, 4, 2},
    {1, 14, "2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096, {0, 2, 4}, 3, 2},
    {2, 9, "3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448, {0, 4}, 2, 4},
    {3, 5, "4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448, {0}, 1, 4},
    {4, 0, "7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152, {0}, 1, 8},
};
#define N_PROFILES (sizeof H100_80GB / sizeof *H100_80GB)

/* Compute instance profiles (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) -> their compute slices. */
static unsigned int ci_slices(unsigned int profile) {
    static const unsigned int slices[] = {1, 2, 3, 4, 7};
    return profile < sizeof slices / sizeof *slices ? slices[profile] : 0;
}

/* -- instances --------------------------------------------------------------------------------- */

struct ci {
    int used;
    unsigned int id, slices;
    char uuid[NAME_SIZE];
    struct gi *gi;
};

struct gi {
    int used;
    unsigned int id, gpu;
    const struct profile *profile;
    unsigned int start;
    struct ci cis[MAX_CIS];
};

static struct gi instances[MAX_GPUS][MAX_GIS];

void mig_reset(unsigned int index) {
    if (index < MAX_GPUS)
        memset(instances[index], 0, sizeof instances[index]);
}

static const struct profile *by_enum(const struct gpu *g, unsigned int e) {
    for (unsigned int i = 0; g->mig_table && i < N_PROFILES; i++)
        if (H100_80GB[i].enumv == e)
            return &H100_80GB[i];
    return NULL;
}

static const struct profile *by_id(const struct gpu *g, unsigned int id) {
    for (unsigned int i = 0; g->mig_table && i < N_PROFILES; i++)
        if (H100_80GB[i].id == id)
            return &H100_80GB[i];
    return NULL;
}

static struct gi *gi_of(nvmlGpuInstance_t h) {
    uintptr_t at = (uintptr_t)h, first = (uintptr_t)instances;
    if (!initialized() || at < first || at >= first + sizeof instances || (at - first) % sizeof(struct gi))
        return NULL;
    return h->used ? h : NULL;
}

static struct ci *ci_of(const void *h) {
    /* A compute instance handle, and a MIG device handle, point at a `struct ci`. */
    for (unsigned int g = 0; initialized() && g < MAX_GPUS; g++)
        for (unsigned int i = 0; i < MAX_GIS; i++) {
            uintptr_t at = (uintptr_t)h, first = (uintptr_t)instances[g][i].cis;
            if (at >= first && at < first + sizeof instances[g][i].cis && (at - first) % sizeof(struct ci) == 0)
                return ((struct ci *)h)->used ? (struct ci *)h : NULL;
        }
    return NULL;
}

const char *mig_uuid_of(nvmlDevice_t device) {
    const struct ci *ci = ci_of(device);
    return ci ? ci->uuid : NULL;
}

static nvmlReturn_t list(void *array, size_t item, unsigned int *count, const void *items, unsigned int n) {
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (array) {
        if (*count < n) {
            *count = n;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        memcpy(array, items, item * n);
    }
    *count = n;
    return NVML_SUCCESS;
}

static void put_name(char *dst, const char *src) { snprintf(dst, NAME_SIZE, "%s", src); }

/* The access capability's directory of a GPU instance (`ci` < 0) or compute instance, under
 * $NVML_STANDIN_PROC; 0 when there is none to write. */
static int cap_dir(const struct gi *gi, int ci, char *buf, size_t size) {
    const char *proc = getenv("NVML_STANDIN_PROC");
    if (!proc || !*proc)
        return 0;
    int n = snprintf(buf, size, "%s/driver/nvidia/capabilities/gpu%u/mig/gi%u", proc, gpus[gi->gpu].minor, gi->id);
    if (ci >= 0)
        snprintf(buf + n, size - (size_t)n, "/ci%d", ci);
    return 1;
}

static void mkdirs(char *path) {
    for (char *p = path + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(path, 0755);
            *p = '/';
        }
    mkdir(path, 0755);
}

static void publish_cap(const struct gi *gi, int ci) {
    char dir[PATH_MAX], file[PATH_MAX + 8];
    if (!cap_dir(gi, ci, dir, sizeof dir))
        return;
    mkdirs(dir);
    unsigned int minor = 3 + gpus[gi->gpu].minor * 135 + gi->id * 9 + (ci >= 0 ? 1 + (unsigned int)ci : 0);
    snprintf(file, sizeof file, "%s/access", dir);
    FILE *f = fopen(file, "w");
    if (f) {
        fprintf(f, "DeviceFileMinor: %u\nDeviceFileMode: 292\nDeviceFileModify: 1\n", minor);
        fclose(f);
    }
}

static void withdraw_cap(const struct gi *gi, int ci) {
    char dir[PATH_MAX], file[PATH_MAX + 8];
    if (!cap_dir(gi, ci, dir, sizeof dir))
        return;
    snprintf(file, sizeof file, "%s/access", dir);
    unlink(file);
    rmdir(dir);
}

/* -- MIG mode ---------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    GPU_OR_RETURN(g, device);
    if (g->mig_current == UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    if (mode > MIG_ENABLE || !activationStatus)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mode != MIG_ENABLE)
        for (unsigned int i = 0; i < MAX_GIS; i++)
            if (instances[g - gpus][i].used)
                return NVML_ERROR_IN_USE;
    g->mig_current = g->mig_pending = (int)mode; /* in effect at once, as an H100 does without a reset */
    *activationStatus = NVML_SUCCESS;
    return NVML_SUCCESS;
}

/* -- profiles and placements ------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_v2_t *info) {
    GPU_OR_RETURN(g, device);
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const struct profile *p = by_enum(g, profile);
    if (!p)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->version = nvmlGpuInstanceProfileInfo_v2;
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->copy;
    info->decoderCount = p->dec;
    info->encoderCount = p->enc;
    info->jpegCount = p->jpeg;
    info->ofaCount = p->ofa;
    info->memorySizeMB = p->memory_mib;
    char name[NAME_SIZE];
    snprintf(name, sizeof name, "MIG %s", p->name);
    put_name(info->name, name);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                  nvmlGpuInstancePlacement_t *placements,
                                                                  unsigned int *count) {
    GPU_OR_RETURN(g, device);
    const struct profile *p = by_id(g, profileId);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlGpuInstancePlacement_t all[8];
    for (unsigned int i = 0; i < p->nstarts; i++)
        all[i] = (nvmlGpuInstancePlacement_t){p->starts[i], p->size};
    return list(placements, sizeof *all, count, all, p->nstarts);
}

/* -- GPU instances ----------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                             const nvmlGpuInstancePlacement_t *placement,
                                                             nvmlGpuInstance_t *gpuInstance) {
    GPU_OR_RETURN(g, device);
    const struct profile *p = by_id(g, profileId);
    if (!p || !placement || !gpuInstance)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->mig_current != MIG_ENABLE)
        return NVML_ERROR_NOT_SUPPORTED;
    int listed = 0;
    for (unsigned int i = 0; i < p->nstarts; i++)
        listed |= p->starts[i] == placement->start;
    if (!listed || placement->size != p->size)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct gi *gis = instances[g - gpus];
    unsigned int same = 0, used_ids = 0;
    for (unsigned int i = 0; i < MAX_GIS; i++) {
        if (!gis[i].used)
            continue;
        used_ids |= 1u << gis[i].id;
        same += gis[i].profile == p;
        if (gis[i].start < placement->start + p->size && placement->start < gis[i].start + gis[i].profile->size)
            return NVML_ERROR_INSUFFICIENT_RESOURCES; /* shares a memory slice */
    }
    if (same >= p->instances)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    for (unsigned int i = 0; i < MAX_GIS; i++) {
        if (gis[i].used)
            continue;
        unsigned int id = 1;
        while (used_ids & (1u << id))
            id++;
        memset(&gis[i], 0, sizeof gis[i]);
        gis[i] = (struct gi){.used = 1, .id = id, .gpu = (unsigned int)(g - gpus), .profile = p,
                             .start = placement->start};
        publish_cap(&gis[i], -1);
        *gpuInstance = &gis[i];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                              nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    GPU_OR_RETURN(g, device);
    const struct profile *p = by_id(g, profileId);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->mig_current != MIG_ENABLE)
        return NVML_ERROR_NOT_SUPPORTED;
    nvmlGpuInstance_t found[MAX_GIS];
    unsigned int n = 0;
    for (unsigned int i = 0; i < MAX_GIS; i++)
        if (instances[g - gpus][i].used && instances[g - gpus][i].profile == p)
            found[n++] = &instances[g - gpus][i];
    return list(gpuInstances, sizeof *found, count, found, n);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                 nvmlGpuInstance_t *gpuInstance) {
    GPU_OR_RETURN(g, device);
    if (!gpuInstance)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->mig_current != MIG_ENABLE)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < MAX_GIS; i++)
        if (instances[g - gpus][i].used && instances[g - gpus][i].id == id) {
            *gpuInstance = &instances[g - gpus][i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    struct gi *gi = gi_of(gpuInstance);
    if (!gi || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = &gpus[gi->gpu];
    info->id = gi->id;
    info->profileId = gi->profile->id;
    info->placement = (nvmlGpuInstancePlacement_t){gi->start, gi->profile->size};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    struct gi *gi = gi_of(gpuInstance);
    if (!gi)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < MAX_CIS; i++)
        if (gi->cis[i].used)
            return NVML_ERROR_IN_USE;
    withdraw_cap(gi, -1);
    gi->used = 0;
    return NVML_SUCCESS;
}

/* -- compute instances ------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                   unsigned int engProfile,
                                                                   nvmlComputeInstanceProfileInfo_v2_t *info) {
    struct gi *gi = gi_of(gpuInstance);
    if (!gi || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlComputeInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned int slices = ci_slices(profile);
    if (!slices || slices > gi->profile->slices)
        return NVML_ERROR_NOT_SUPPORTED;
    if (engProfile != 0) /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED */
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct profile *p = gi->profile;
    memset(info, 0, sizeof *info);
    info->version = nvmlComputeInstanceProfileInfo_v2;
    info->id = profile;
    info->sliceCount = slices;
    info->instanceCount = p->slices / slices;
    info->multiprocessorCount = p->sms * slices / p->slices;
    info->sharedCopyEngineCount = p->copy;
    info->sharedDecoderCount = p->dec;
    info->sharedEncoderCount = p->enc;
    info->sharedJpegCount = p->jpeg;
    info->sharedOfaCount = p->ofa;
    char name[NAME_SIZE];
    if (slices == p->slices)
        snprintf(name, sizeof name, "MIG %s", p->name);
    else
        snprintf(name, sizeof name, "MIG %uc.%s", slices, p->name);
    put_name(info->name, name);
    return NVML_SUCCESS;
}

static void fresh_uuid(char *out) {
    unsigned char b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b)
        memset(b, 0, sizeof b); /* never on Linux with a seeded pool; a fixed UUID then */
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    snprintf(out, NAME_SIZE, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                         nvmlComputeInstance_t *computeInstance) {
    struct gi *gi = gi_of(gpuInstance);
    if (!gi || !computeInstance)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int slices = ci_slices(profileId), used = 0, used_ids = 0;
    if (!slices || slices > gi->profile->slices)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < MAX_CIS; i++)
        if (gi->cis[i].used) {
            used += gi->cis[i].slices;
            used_ids |= 1u << gi->cis[i].id;
        }
    if (used + slices > gi->profile->slices)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    for (unsigned int i = 0; i < MAX_CIS; i++) {
        if (gi->cis[i].used)
            continue;
        unsigned int id = 0;
        while (used_ids & (1u << id))
            id++;
        gi->cis[i] = (struct ci){.used = 1, .id = id, .slices = slices, .gi = gi};
        fresh_uuid(gi->cis[i].uuid);
        publish_cap(gi, (int)id);
        *computeInstance = &gi->cis[i];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                       nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    struct gi *gi = gi_of(gpuInstance);
    if (!gi)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int slices = ci_slices(profileId);
    if (!slices)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlComputeInstance_t found[MAX_CIS];
    unsigned int n = 0;
    for (unsigned int i = 0; i < MAX_CIS; i++)
        if (gi->cis[i].used && gi->cis[i].slices == slices)
            found[n++] = &gi->cis[i];
    return list(computeInstances, sizeof *found, count, found, n);
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                  nvmlComputeInstanceInfo_t *info) {
    struct ci *ci = ci_of(computeInstance);
    if (!ci || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = &gpus[ci->gi->gpu];
    info->gpuInstance = ci->gi;
    info->id = ci->id;
    info->profileId = 0;
    for (unsigned int p = 0; p < 5; p++)
        if (ci_slices(p) == ci->slices)
            info->profileId = p;
    info->placement = (nvmlGpuInstancePlacement_t){0, ci->slices};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    struct ci *ci = ci_of(computeInstance);
    if (!ci)
        return NVML_ERROR_INVALID_ARGUMENT;
    withdraw_cap(ci->gi, (int)ci->id);
    ci->used = 0;
    return NVML_SUCCESS;
}

/* -- MIG devices ------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    GPU_OR_RETURN(g, device);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g->mig_table ? 7 : 0; /* one per compute slice */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    GPU_OR_RETURN(g, device);
    if (!migDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned int id = 1; id < 32; id++) /* in GPU instance id order, then compute instance id */
        for (unsigned int i = 0; i < MAX_GIS; i++) {
            struct gi *gi = &instances[g - gpus][i];
            if (!gi->used || gi->id != id)
                continue;
            for (unsigned int cid = 0; cid < MAX_CIS; cid++)
                for (unsigned int c = 0; c < MAX_CIS; c++)
                    if (gi->cis[c].used && gi->cis[c].id == cid && n++ == index) {
                        *migDevice = (nvmlDevice_t)(void *)&gi->cis[c];
                        return NVML_SUCCESS;
                    }
        }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    if (!isMigDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = ci_of(device) != NULL;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    const struct ci *ci = ci_of(device);
    if (!ci || !id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = ci->gi->id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    const struct ci *ci = ci_of(device);
    if (!ci || !id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = ci->id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    const struct ci *ci = ci_of(migDevice);
    if (!ci || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[ci->gi->gpu];
    return NVML_SUCCESS;
}
