/*
 * unisleep's torch_memory_saver-compatible native library, installed as
 * unisleep/torch_memory_saver_hook_mode_preload.abi3.so (the name and place slime and AReaL look
 * for next to ``torch_memory_saver.__file__``).
 *
 * What it holds:
 *
 *  1. torch_memory_saver 0.0.10's per-thread allocation settings and their C entry points, with
 *     that library's names and meaning: ``tms_{get,set}_interesting_region``, ``_current_tag``,
 *     ``_enable_cpu_backup``, ``_cpu_backup_backend``, ``_enable_disk_backup``.  Each thread starts
 *     from the environment (TMS_INIT_ENABLE, TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_ENABLE_DISK_BACKUP,
 *     TMS_INIT_CPU_BACKUP_BACKEND) and tag "default".  A setter called by someone else's code
 *     (slime's DeepEP patch) notifies the facade through the listener it registered.
 *
 *  2. The allocation hooks of unisleep's whole-process capture.  Python writes their addresses
 *     into the import table of torch's allocator library (see unisleep/backends/_capture.py); a
 *     hook hands an allocation to the facade's callback when the calling thread is in an
 *     "interesting region" (and not already inside the callback), and otherwise calls the real
 *     function.  Pointers the callback handed out are remembered here, so their free goes back
 *     to the callback and every other free goes straight to the real function.
 *
 *  3. A constructor for LD_PRELOAD.  When this file is named in LD_PRELOAD (as slime and AReaL do
 *     for torch_memory_saver's library) it sets UNISLEEP_TMS=1 (unless set) and puts unisleep's
 *     shim folder first on PYTHONPATH, so ``import torch_memory_saver`` in that Python process
 *     gives unisleep's facade.  It interposes no function, starts no thread, touches no device
 *     and prints nothing; loaded any other way (ctypes) it changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define TAG_MAX 256

/* ------------------------------------------------------------------ per-thread settings */
enum { UNSET = -1 };
enum { BACKEND_PINNED = 0, BACKEND_MMAP = 1 };

static __thread int t_interesting = UNSET;
static __thread int t_cpu_backup = UNSET;
static __thread int t_disk_backup = UNSET;
static __thread int t_backend = UNSET;
static __thread int t_tag_set = 0;
static __thread char t_tag[TAG_MAX];
static __thread int t_in_hook = 0;

/* torch_memory_saver's reading of a boolean variable: 1/true/TRUE/yes/YES are on; unset or
 * anything else is off here (the facade refuses other values before it starts). */
static int env_bool(const char *name) {
    const char *v = getenv(name);
    if (v == NULL) return 0;
    return strcmp(v, "1") == 0 || strcmp(v, "true") == 0 || strcmp(v, "TRUE") == 0 || strcmp(v, "yes") == 0 ||
           strcmp(v, "YES") == 0;
}

static int env_backend(void) {
    const char *v = getenv("TMS_INIT_CPU_BACKUP_BACKEND");
    return (v != NULL && strcmp(v, "mmap") == 0) ? BACKEND_MMAP : BACKEND_PINNED;
}

static int interesting(void) {
    if (t_interesting == UNSET) t_interesting = env_bool("TMS_INIT_ENABLE");
    return t_interesting;
}

typedef void (*listener_t)(int what, int value);
static listener_t g_listener = NULL;

API void unisleep_tms_set_listener(listener_t fn) { g_listener = fn; }

API void tms_set_interesting_region(bool value) {
    t_interesting = value ? 1 : 0;
    listener_t fn = g_listener;
    if (fn != NULL) fn(1, value ? 1 : 0);
}

API bool tms_get_interesting_region(void) { return interesting() != 0; }

API void tms_set_current_tag(const char *tag) {
    if (tag == NULL) return;
    strncpy(t_tag, tag, TAG_MAX - 1);
    t_tag[TAG_MAX - 1] = '\0';
    t_tag_set = 1;
}

API const char *tms_get_current_tag(void) { return t_tag_set ? t_tag : "default"; }

API void tms_set_enable_cpu_backup(bool value) { t_cpu_backup = value ? 1 : 0; }

API bool tms_get_enable_cpu_backup(void) {
    if (t_cpu_backup == UNSET) t_cpu_backup = env_bool("TMS_INIT_ENABLE_CPU_BACKUP");
    return t_cpu_backup != 0;
}

/* "mmap" or "pinned"; anything else is refused (the previous value stays, 0 is returned) */
API int unisleep_tms_set_cpu_backup_backend(const char *backend) {
    if (backend == NULL) return 0;
    if (strcmp(backend, "mmap") == 0) t_backend = BACKEND_MMAP;
    else if (strcmp(backend, "pinned") == 0) t_backend = BACKEND_PINNED;
    else return 0;
    return 1;
}

API void tms_set_cpu_backup_backend(const char *backend) {
    if (!unisleep_tms_set_cpu_backup_backend(backend))
        fprintf(stderr, "[unisleep torch_memory_saver] cpu_backup_backend must be mmap or pinned, got %s; kept %s\n",
                backend ? backend : "(null)", t_backend == BACKEND_MMAP ? "mmap" : "pinned");
}

API const char *tms_get_cpu_backup_backend(void) {
    if (t_backend == UNSET) t_backend = env_backend();
    return t_backend == BACKEND_MMAP ? "mmap" : "pinned";
}

API void tms_set_enable_disk_backup(bool value) { t_disk_backup = value ? 1 : 0; }

API bool tms_get_enable_disk_backup(void) {
    if (t_disk_backup == UNSET) t_disk_backup = env_bool("TMS_INIT_ENABLE_DISK_BACKUP");
    return t_disk_backup != 0;
}

/* ------------------------------------------------------------------ owned pointers */
/* open addressing, linear probing, tombstones; grows at half load */
#define EMPTY ((uintptr_t)0)
#define GONE ((uintptr_t)1)
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t *g_slots = NULL;
static size_t g_cap = 0, g_used = 0, g_live = 0;
static volatile size_t g_live_hint = 0; /* read without the lock: 0 means "surely not ours" */

static size_t slot_of(uintptr_t p, size_t cap) {
    uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int set_grow(void) {
    size_t cap = g_cap ? g_cap * 2 : 1024;
    uintptr_t *slots = calloc(cap, sizeof(uintptr_t));
    if (slots == NULL) return 0;
    for (size_t i = 0; i < g_cap; i++) {
        uintptr_t p = g_slots[i];
        if (p > GONE) {
            size_t j = slot_of(p, cap);
            while (slots[j] != EMPTY) j = (j + 1) & (cap - 1);
            slots[j] = p;
        }
    }
    free(g_slots);
    g_slots = slots;
    g_cap = cap;
    g_used = g_live;
    return 1;
}

static int set_add(uintptr_t p) {
    int ok = 1;
    pthread_mutex_lock(&g_lock);
    if ((g_used + 1) * 2 > g_cap) ok = set_grow();
    if (ok) {
        size_t j = slot_of(p, g_cap);
        while (g_slots[j] > GONE && g_slots[j] != p) j = (j + 1) & (g_cap - 1);
        if (g_slots[j] != p) {
            if (g_slots[j] == EMPTY) g_used++;
            g_slots[j] = p;
            g_live++;
        }
        g_live_hint = g_live;
    }
    pthread_mutex_unlock(&g_lock);
    return ok;
}

static int set_remove(uintptr_t p) {
    if (g_live_hint == 0 || p <= GONE) return 0;
    int found = 0;
    pthread_mutex_lock(&g_lock);
    if (g_cap) {
        size_t j = slot_of(p, g_cap);
        while (g_slots[j] != EMPTY) {
            if (g_slots[j] == p) {
                g_slots[j] = GONE;
                g_live--;
                found = 1;
                break;
            }
            j = (j + 1) & (g_cap - 1);
        }
    }
    g_live_hint = g_live;
    pthread_mutex_unlock(&g_lock);
    return found;
}

API size_t unisleep_capture_owned(void) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_live;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* ------------------------------------------------------------------ hooks */
/* the allocation callback returns the address, DECLINED (the real function serves this one) or
 * FAILED (out of memory: the hook reports it as the real function would) */
#define DECLINED ((uintptr_t)0)
#define FAILED ((uintptr_t)1)
typedef uintptr_t (*alloc_cb_t)(size_t size, size_t align);
typedef void (*free_cb_t)(uintptr_t ptr);

static alloc_cb_t g_alloc_cb = NULL;
static free_cb_t g_free_cb = NULL;
static int (*g_real_dev_malloc)(void **, size_t) = NULL;
static int (*g_real_dev_free)(void *) = NULL;
static int (*g_real_posix_memalign)(void **, size_t, size_t) = NULL;
static void (*g_real_free)(void *) = NULL;

/* the callbacks (NULL to stop capturing: every hook then calls the real function) */
API void unisleep_capture_set_callbacks(alloc_cb_t alloc_cb, free_cb_t free_cb) {
    g_alloc_cb = alloc_cb;
    g_free_cb = free_cb;
}

/* the real functions, resolved by the caller before any hook can run */
API void unisleep_capture_set_real_device(void *malloc_fn, void *free_fn) {
    g_real_dev_malloc = (int (*)(void **, size_t))malloc_fn;
    g_real_dev_free = (int (*)(void *))free_fn;
}

API void unisleep_capture_set_real_host(void *posix_memalign_fn, void *free_fn) {
    g_real_posix_memalign = (int (*)(void **, size_t, size_t))posix_memalign_fn;
    g_real_free = (void (*)(void *))free_fn;
}

/* 1 while the calling thread runs a capture callback (its own allocations are not captured) */
API int unisleep_capture_in_callback(void) { return t_in_hook; }

static uintptr_t capture(size_t size, size_t align) {
    alloc_cb_t cb = g_alloc_cb;
    if (cb == NULL) return DECLINED;
    t_in_hook = 1;
    uintptr_t p = cb(size, align);
    t_in_hook = 0;
    if (p > FAILED && !set_add(p)) {
        /* cannot remember it: give it back rather than leak it into the real free */
        free_cb_t fcb = g_free_cb;
        t_in_hook = 1;
        if (fcb != NULL) fcb(p);
        t_in_hook = 0;
        return FAILED;
    }
    return p;
}

static int wants(void) { return g_alloc_cb != NULL && !t_in_hook && interesting(); }

static void release(uintptr_t p) {
    free_cb_t fcb = g_free_cb;
    int was = t_in_hook;
    t_in_hook = 1;
    if (fcb != NULL) fcb(p);
    t_in_hook = was;
}

/* same signature and error codes for the CUDA and HIP runtimes: 0 = success, 2 = out of memory */
API int unisleep_hook_device_malloc(void **ptr, size_t size) {
    if (wants()) {
        uintptr_t p = capture(size, 0);
        if (p == FAILED) {
            *ptr = NULL;
            return 2;
        }
        if (p != DECLINED) {
            *ptr = (void *)p;
            return 0;
        }
    }
    return g_real_dev_malloc(ptr, size);
}

API int unisleep_hook_device_free(void *ptr) {
    if (set_remove((uintptr_t)ptr)) {
        release((uintptr_t)ptr);
        return 0;
    }
    return g_real_dev_free(ptr);
}

API int unisleep_hook_posix_memalign(void **ptr, size_t align, size_t size) {
    if (wants()) {
        uintptr_t p = capture(size, align);
        if (p == FAILED) return ENOMEM;
        if (p != DECLINED) {
            *ptr = (void *)p;
            return 0;
        }
    }
    return g_real_posix_memalign(ptr, align, size);
}

API void unisleep_hook_free(void *ptr) {
    if (set_remove((uintptr_t)ptr)) {
        release((uintptr_t)ptr);
        return;
    }
    g_real_free(ptr);
}

/* ------------------------------------------------------------------ LD_PRELOAD set-up */
static int named_in_preload(const char *self) {
    const char *pre = getenv("LD_PRELOAD");
    if (pre == NULL || self == NULL) return 0;
    char real_self[PATH_MAX];
    if (realpath(self, real_self) == NULL) return 0;
    const char *p = pre;
    while (*p) {
        while (*p == ':' || *p == ' ') p++;
        const char *e = p;
        while (*e && *e != ':' && *e != ' ') e++;
        size_t n = (size_t)(e - p);
        if (n > 0 && n < PATH_MAX) {
            char entry[PATH_MAX], real_entry[PATH_MAX];
            memcpy(entry, p, n);
            entry[n] = '\0';
            if (realpath(entry, real_entry) != NULL && strcmp(real_entry, real_self) == 0) return 1;
        }
        p = e;
    }
    return 0;
}

static void prepend_pythonpath(const char *dir) {
    const char *old = getenv("PYTHONPATH");
    size_t n = strlen(dir);
    if (old != NULL) {
        const char *p = old;
        while (*p) { /* already there: leave it */
            const char *e = strchr(p, ':');
            size_t m = e ? (size_t)(e - p) : strlen(p);
            if (m == n && strncmp(p, dir, n) == 0) return;
            if (!e) break;
            p = e + 1;
        }
    }
    size_t total = n + 1 + (old ? strlen(old) + 1 : 0);
    char *val = malloc(total);
    if (val == NULL) return;
    if (old != NULL && *old) snprintf(val, total, "%s:%s", dir, old);
    else snprintf(val, total, "%s", dir);
    setenv("PYTHONPATH", val, 1);
    free(val);
}

__attribute__((constructor)) static void unisleep_tms_preload(void) {
    Dl_info info;
    if (dladdr((void *)&unisleep_tms_preload, &info) == 0 || info.dli_fname == NULL) return;
    if (!named_in_preload(info.dli_fname)) return;
    char here[PATH_MAX];
    if (realpath(info.dli_fname, here) == NULL) return;
    char *slash = strrchr(here, '/');
    if (slash == NULL) return;
    *slash = '\0';
    char shim[PATH_MAX];
    if (snprintf(shim, sizeof shim, "%s/compat/shim", here) >= (int)sizeof shim) return;
    char probe[PATH_MAX];
    if (snprintf(probe, sizeof probe, "%s/torch_memory_saver/__init__.py", shim) >= (int)sizeof probe) return;
    if (access(probe, R_OK) != 0) return;
    setenv("UNISLEEP_TMS", "1", 0);
    prepend_pythonpath(shim);
}

/* what this file is, for `unisleep doctor` and the facade's check of a preloaded library */
API const char *unisleep_tms_library(void) { return "unisleep torch_memory_saver compatibility library 1"; }
