/* scratchd.ipc._native: the queue's hot paths in C, over the layout of ipc/layout.py.
 *
 * Python stays the owner of the layout: every offset used here comes from
 * ``layout.native_offsets`` (which asserts each field's dtype against the C type named in
 * ``layout.NATIVE_FIELDS``) when a queue is attached, and is bounds-checked against the
 * mapping here. Nothing in this file knows a numeric offset.
 *
 * Two types:
 *
 *   Mutex(buf, offset)  the robust, process-shared pthread mutex of ipc/lock.py. Each
 *                       method returns the pthread error code; Python decides (EOWNERDEAD →
 *                       repair → consistent stays in ipc/lock.py). The GIL is released only
 *                       around the calls that can block: lock and clocklock.
 *   Core(buf, offsets, fault)
 *                       the critical sections of submit, claim_batch, complete and
 *                       collect_completed (each takes the mutex itself, or runs inside
 *                       Python's hold on its slow path), writing in exactly the order
 *                       documented in ipc/queue.py; the ready lists and the timing wheel
 *                       and the done stack (their only implementation: the Python sections
 *                       call link, unlink, expire, best, earliest_deadline, finish and
 *                       rebuild with the mutex held);
 *                       and the bounded spins (GIL released) before a process sleeps on its
 *                       eventfd. ``fault`` is FaultPoint.reach (or None): called with the
 *                       point's name where ipc/faults.py names a point, so SCRATCHD_IPC_FAULT
 *                       kills the process inside the native critical section.
 *
 * And one function, recv_into_exact: a socket's bytes received into a buffer with the GIL
 * released for the whole run, so the daemon's receive threads copy large frames off the event
 * loop's thread (daemon/frontend/receiver.py).
 *
 * Ordering: a SIGKILL can land between any two instructions, so the compiler must not move
 * the lifecycle write (``state``) before the link writes it publishes; state and the done
 * stack head are written with release stores (a plain store plus a compiler barrier on
 * x86-64). Lock-free readers (the spins) use relaxed atomic loads of aligned words.
 */
#define _GNU_SOURCE 1 /* pthread_mutex_clocklock */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layout_fields.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() __atomic_signal_fence(__ATOMIC_SEQ_CST)
#endif

#define NIL (-1)
#define MUTEX_BYTES 64
#define PRIORITIES 8
_Static_assert(sizeof(pthread_mutex_t) <= MUTEX_BYTES, "pthread_mutex_t outgrew MUTEX_BYTES");

enum { FREE = 0, WRITTEN = 1, QUEUED = 2, CLAIMED = 3, DONE = 4, EXPIRED = 5, FAILED = 6 };
enum { ACTIVE = 1 };

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------- Mutex */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    pthread_mutex_t *m; /* NULL once closed */
} Mutex;

static int Mutex_init(Mutex *self, PyObject *args, PyObject *kw) {
    PyObject *buf;
    Py_ssize_t offset;
    static char *names[] = {"buf", "offset", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "On", names, &buf, &offset)) return -1;
    if (self->m) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex is already bound to a buffer");
        return -1;
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    if (offset < 0 || offset % 64 || offset + MUTEX_BYTES > self->view.len) {
        PyBuffer_Release(&self->view);
        PyErr_Format(PyExc_ValueError, "mutex offset %zd: not 64-byte aligned inside the buffer",
                     offset);
        return -1;
    }
    self->m = (pthread_mutex_t *)((char *)self->view.buf + offset);
    return 0;
}

static void Mutex_dealloc(Mutex *self) {
    if (self->m) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define MUTEX_OPEN(self)                                                   \
    if (!(self)->m) {                                                      \
        PyErr_SetString(PyExc_ValueError, "the mutex's buffer was closed"); \
        return NULL;                                                       \
    }

static PyObject *Mutex_initialize(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    if (!rc) rc = pthread_mutex_init(self->m, &attr);
    pthread_mutexattr_destroy(&attr);
    return PyLong_FromLong(rc);
}

static PyObject *Mutex_trylock(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    return PyLong_FromLong(pthread_mutex_trylock(self->m));
}

static PyObject *Mutex_lock(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    int rc = pthread_mutex_trylock(self->m);
    if (rc == EBUSY) { /* only a contended lock can block: then let other threads run */
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_mutex_lock(self->m);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(rc);
}

static PyObject *Mutex_clocklock(Mutex *self, PyObject *arg) {
    MUTEX_OPEN(self);
    long long deadline = PyLong_AsLongLong(arg);
    if (deadline == -1 && PyErr_Occurred()) return NULL;
    struct timespec when = {(time_t)(deadline / 1000000000), (long)(deadline % 1000000000)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_clocklock(self->m, CLOCK_MONOTONIC, &when);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *Mutex_unlock(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    return PyLong_FromLong(pthread_mutex_unlock(self->m));
}

static PyObject *Mutex_consistent(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    return PyLong_FromLong(pthread_mutex_consistent(self->m));
}

static PyObject *Mutex_word(Mutex *self, PyObject *unused) {
    (void)unused;
    MUTEX_OPEN(self);
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)self->m, __ATOMIC_RELAXED));
}

static PyObject *Mutex_close(Mutex *self, PyObject *unused) {
    (void)unused;
    if (self->m) {
        self->m = NULL;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Mutex_methods[] = {
    {"initialize", (PyCFunction)Mutex_initialize, METH_NOARGS, "init robust/pshared/errorcheck"},
    {"trylock", (PyCFunction)Mutex_trylock, METH_NOARGS, "pthread_mutex_trylock"},
    {"lock", (PyCFunction)Mutex_lock, METH_NOARGS, "pthread_mutex_lock (GIL released)"},
    {"clocklock", (PyCFunction)Mutex_clocklock, METH_O, "clocklock until monotonic ns"},
    {"unlock", (PyCFunction)Mutex_unlock, METH_NOARGS, "pthread_mutex_unlock"},
    {"consistent", (PyCFunction)Mutex_consistent, METH_NOARGS, "pthread_mutex_consistent"},
    {"word", (PyCFunction)Mutex_word, METH_NOARGS, "the futex word (holder tid + flags)"},
    {"close", (PyCFunction)Mutex_close, METH_NOARGS, "release the buffer"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "scratchd.ipc._native.Mutex",
    .tp_basicsize = sizeof(Mutex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mutex_init,
    .tp_dealloc = (destructor)Mutex_dealloc,
    .tp_methods = Mutex_methods,
};

/* -------------------------------------------------------------------------------- Core */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    char *base;       /* NULL once closed */
    PyObject *fault;  /* FaultPoint.reach, or NULL when no point is armed */
    uint64_t *h_seq, *h_waiting, *h_expired;
    int64_t *h_wheel_cursor;
    int32_t *h_done_head;
    uint32_t *h_completion_armed;
    int32_t *h_main_cpu, *h_worker_cpu;
    char *desc;
    Py_ssize_t desc_stride, slots;
    Py_ssize_t d_priority, d_abandoned, d_state, d_generation, d_attempt, d_seq, d_worker,
        d_worker_pid, d_claim_ns, d_done_ns, d_rnext, d_rprev, d_wnext, d_wprev, d_wbucket,
        d_deadline_ns, d_request_id, d_conn_id, d_enqueue_ns, d_part_class, d_height, d_width,
        d_want_mask, d_kills, d_region, d_region_gen, d_region_offset;
    int32_t *ready_head, *ready_tail, *ready_count, *wheel_head;
    Py_ssize_t wheel_ticks;
    int64_t base_ns, tick_ns;
    char *workers;
    Py_ssize_t worker_stride, max_workers, w_pid, w_state, w_batches, w_requests;
    pthread_mutex_t *mutex;
    int spinning; /* threads inside spin() with the GIL released; close() refuses then */
    int64_t next_escape_ns; /* a worker's next chance to leave a shared CPU (see spin()) */
    PyTypeObject *handle;   /* records.Handle (a tuple subclass), or NULL: plain tuples */
    int32_t *free_ring;     /* the free list (this process's memory; see free_pop) */
    Py_ssize_t free_head, free_len;
} Core;

/* Field access: F(c, i, type, member) is descriptor i's field. */
#define F(c, i, T, f) (*(T *)((c)->desc + (Py_ssize_t)(i) * (c)->desc_stride + (c)->f))
#define STATE(c, i) F(c, i, uint8_t, d_state)
#define DEADLINE(c, i) F(c, i, int64_t, d_deadline_ns)
#define SEQ(c, i) F(c, i, uint64_t, d_seq)
#define RNEXT(c, i) F(c, i, int32_t, d_rnext)
#define RPREV(c, i) F(c, i, int32_t, d_rprev)
#define WNEXT(c, i) F(c, i, int32_t, d_wnext)
#define WPREV(c, i) F(c, i, int32_t, d_wprev)
#define W(c, s, T, f) (*(T *)((c)->workers + (Py_ssize_t)(s) * (c)->worker_stride + (c)->f))
#define PUBLISH(ptr, value) __atomic_store_n((ptr), (value), __ATOMIC_RELEASE)

#define M(name) offsetof(Core, name)
static const Field DESC_FIELDS[] = {
    {"d.priority", 1, M(d_priority)}, {"d.abandoned", 1, M(d_abandoned)},
    {"d.state", 1, M(d_state)},       {"d.generation", 4, M(d_generation)},
    {"d.attempt", 4, M(d_attempt)},   {"d.seq", 8, M(d_seq)},
    {"d.worker", 4, M(d_worker)},     {"d.worker_pid", 4, M(d_worker_pid)},
    {"d.claim_ns", 8, M(d_claim_ns)}, {"d.done_ns", 8, M(d_done_ns)},
    {"d.rnext", 4, M(d_rnext)},       {"d.rprev", 4, M(d_rprev)},
    {"d.wnext", 4, M(d_wnext)},       {"d.wprev", 4, M(d_wprev)},
    {"d.wbucket", 4, M(d_wbucket)},   {"d.deadline_ns", 8, M(d_deadline_ns)},
    {"d.request_id", 8, M(d_request_id)}, {"d.conn_id", 8, M(d_conn_id)},
    {"d.enqueue_ns", 8, M(d_enqueue_ns)}, {"d.part_class", 4, M(d_part_class)},
    {"d.height", 4, M(d_height)},     {"d.width", 4, M(d_width)},
    {"d.want_mask", 1, M(d_want_mask)}, {"d.kills", 1, M(d_kills)},
    {"d.region", 4, M(d_region)},     {"d.region_gen", 4, M(d_region_gen)},
    {"d.region_offset", 8, M(d_region_offset)},
};
static const Field WORKER_FIELDS[] = {
    {"w.pid", 4, M(w_pid)}, {"w.state", 1, M(w_state)},
    {"w.batches", 8, M(w_batches)}, {"w.requests", 8, M(w_requests)},
};
static const Field HEADER_FIELDS[] = {
    {"h.seq", 8, M(h_seq)},           {"h.waiting", 8, M(h_waiting)},
    {"h.expired", 8, M(h_expired)},   {"h.wheel_cursor", 8, M(h_wheel_cursor)},
    {"h.done_head", 4, M(h_done_head)}, {"h.completion_armed", 4, M(h_completion_armed)},
    {"h.main_cpu", 4, M(h_main_cpu)}, {"h.worker_cpu", 4, M(h_worker_cpu)},
};
static int offset_of(PyObject *offsets, const char *key, Py_ssize_t *out) {
    return layout_offset(offsets, "native layout", key, PY_SSIZE_T_MIN, out);
}

/* Bind a table's per-row fields: each naturally aligned and inside the row. */
static int bind_row(Core *c, PyObject *offsets, const Field *fs, size_t n, Py_ssize_t stride) {
    for (size_t k = 0; k < n; k++) {
        Py_ssize_t off;
        if (offset_of(offsets, fs[k].key, &off) < 0) return -1;
        if (off < 0 || off % fs[k].size || off + fs[k].size > stride) {
            PyErr_Format(PyExc_ValueError, "native layout: %s at %zd does not fit", fs[k].key, off);
            return -1;
        }
        *(Py_ssize_t *)((char *)c + fs[k].member) = off;
    }
    return 0;
}

/* A pointer to `bytes` bytes at offsets[key], aligned to `align`, inside the buffer. */
static void *region(Core *c, PyObject *offsets, const char *key, Py_ssize_t bytes, int align) {
    Py_ssize_t off;
    if (offset_of(offsets, key, &off) < 0) return NULL;
    if (off < 0 || off % align || bytes < 0 || off + bytes > c->view.len) {
        PyErr_Format(PyExc_ValueError, "native layout: %s at %zd outside the buffer", key, off);
        return NULL;
    }
    return c->base + off;
}

static int bind_layout(Core *c, PyObject *o) {
    Py_ssize_t ticks, base, tick;
    if (offset_of(o, "slots", &c->slots) < 0 || offset_of(o, "desc_stride", &c->desc_stride) < 0 ||
        offset_of(o, "max_workers", &c->max_workers) < 0 ||
        offset_of(o, "worker_stride", &c->worker_stride) < 0 ||
        offset_of(o, "wheel_ticks", &ticks) < 0 || offset_of(o, "base_ns", &base) < 0 ||
        offset_of(o, "tick_ns", &tick) < 0)
        return -1;
    if (c->slots < 1 || c->slots > INT32_MAX || c->max_workers < 1 || c->max_workers > 64 ||
        ticks < 1 || tick < 1 || c->desc_stride % 8 || c->worker_stride % 8) {
        PyErr_SetString(PyExc_ValueError, "native layout: geometry out of range");
        return -1;
    }
    c->wheel_ticks = ticks, c->base_ns = base, c->tick_ns = tick;
    if (bind_row(c, o, DESC_FIELDS, COUNT(DESC_FIELDS), c->desc_stride) < 0 ||
        bind_row(c, o, WORKER_FIELDS, COUNT(WORKER_FIELDS), c->worker_stride) < 0)
        return -1;
    for (size_t k = 0; k < COUNT(HEADER_FIELDS); k++) {
        void *p = region(c, o, HEADER_FIELDS[k].key, HEADER_FIELDS[k].size, HEADER_FIELDS[k].size);
        if (!p) return -1;
        *(void **)((char *)c + HEADER_FIELDS[k].member) = p;
    }
    c->desc = region(c, o, "desc_off", c->slots * c->desc_stride, 8);
    c->workers = region(c, o, "worker_off", c->max_workers * c->worker_stride, 8);
    c->ready_head = region(c, o, "ready_head", PRIORITIES * 4, 4);
    c->ready_tail = region(c, o, "ready_tail", PRIORITIES * 4, 4);
    c->ready_count = region(c, o, "ready_count", PRIORITIES * 4, 4);
    c->wheel_head = region(c, o, "wheel_head", ticks * 4, 4);
    c->mutex = region(c, o, "mutex", MUTEX_BYTES, 64);
    return (c->desc && c->workers && c->ready_head && c->ready_tail && c->ready_count &&
            c->wheel_head && c->mutex) ? 0 : -1;
}

static int Core_init(Core *self, PyObject *args, PyObject *kw) {
    PyObject *buf, *offsets, *fault = Py_None, *handle = Py_None;
    static char *names[] = {"buf", "offsets", "fault", "handle", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OO", names, &buf, &PyDict_Type, &offsets,
                                     &fault, &handle))
        return -1;
    if (self->base) {
        PyErr_SetString(PyExc_RuntimeError, "Core is already bound to a buffer");
        return -1;
    }
    if (handle != Py_None && !handle_type_ok(handle)) return -1;
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->base = self->view.buf;
    if (bind_layout(self, offsets) < 0 ||
        !(self->free_ring = PyMem_Calloc((size_t)self->slots, sizeof(int32_t)))) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        self->base = NULL;
        PyBuffer_Release(&self->view);
        return -1;
    }
    self->free_head = self->free_len = 0;
    if (handle != Py_None) self->handle = (PyTypeObject *)Py_NewRef(handle);
    if (fault != Py_None) {
        Py_INCREF(fault);
        self->fault = fault;
    }
    return 0;
}

static void Core_dealloc(Core *self) {
    if (self->base) PyBuffer_Release(&self->view);
    PyMem_Free(self->free_ring);
    Py_XDECREF(self->fault);
    Py_XDECREF(self->handle);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ----------------------------------------------------------- shared steps (lock held) */
static int corrupt(const char *what, long i) {
    PyErr_Format(PyExc_RuntimeError, "queue index corrupt: %s (%ld)", what, i);
    return -1;
}
#define LINK_OK(c, j) ((j) == NIL || ((j) >= 0 && (j) < (c)->slots))

static int reach(Core *c, const char *point) {
    if (!c->fault) return 0;
    PyObject *r = PyObject_CallFunction(c->fault, "s", point);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Insert i in its priority's ready list, by (deadline, seq): walk back from the tail. */
static int ready_push(Core *c, int32_t i) {
    uint8_t p = F(c, i, uint8_t, d_priority);
    if (p >= PRIORITIES) return corrupt("priority", p);
    int64_t d = DEADLINE(c, i);
    uint64_t s = SEQ(c, i);
    int32_t j = c->ready_tail[p];
    for (Py_ssize_t hops = 0; j != NIL; j = RPREV(c, j)) {
        if (!LINK_OK(c, j) || ++hops > c->slots) return corrupt("ready link", j);
        if (!(DEADLINE(c, j) > d || (DEADLINE(c, j) == d && SEQ(c, j) > s))) break;
    }
    int32_t after = j == NIL ? c->ready_head[p] : RNEXT(c, j);
    if (!LINK_OK(c, after)) return corrupt("ready link", after);
    RPREV(c, i) = j;
    RNEXT(c, i) = after;
    if (after == NIL) c->ready_tail[p] = i;
    else RPREV(c, after) = i;
    if (j == NIL) c->ready_head[p] = i;
    else RNEXT(c, j) = i;
    c->ready_count[p] += 1;
    return 0;
}

/* Unlink i from its priority's ready list. */
static int ready_remove(Core *c, int32_t i) {
    uint8_t p = F(c, i, uint8_t, d_priority);
    int32_t n = RNEXT(c, i), q = RPREV(c, i);
    if (p >= PRIORITIES || !LINK_OK(c, n) || !LINK_OK(c, q)) return corrupt("ready entry", i);
    if (q == NIL) c->ready_head[p] = n;
    else RNEXT(c, q) = n;
    if (n == NIL) c->ready_tail[p] = q;
    else RPREV(c, n) = q;
    RNEXT(c, i) = RPREV(c, i) = NIL;
    c->ready_count[p] -= 1;
    return 0;
}

/* The head of the highest non-empty priority, or NIL. */
static int32_t ready_best(Core *c) {
    for (int p = PRIORITIES - 1; p >= 0; p--)
        if (c->ready_count[p]) return c->ready_head[p];
    return NIL;
}

/* The wheel tick of monotonic time ns (before the clock base: INT64_MIN). */
static int64_t tick_of(Core *c, int64_t ns) {
    return ns < c->base_ns ? INT64_MIN : (ns - c->base_ns) / c->tick_ns;
}

/* Link i into bucket max(tick(deadline), cursor) mod wheel_ticks: a deadline already behind
 * the cursor goes to the cursor's bucket, which the next expire visits first. */
static void wheel_insert(Core *c, int32_t i) {
    int64_t t = tick_of(c, DEADLINE(c, i)), cursor = *c->h_wheel_cursor;
    if (t < cursor) t = cursor;
    int64_t b = t % c->wheel_ticks;
    if (b < 0) b += c->wheel_ticks;
    int32_t first = c->wheel_head[b];
    F(c, i, int32_t, d_wbucket) = (int32_t)b;
    WPREV(c, i) = NIL;
    WNEXT(c, i) = first;
    if (first != NIL) WPREV(c, first) = i;
    c->wheel_head[b] = i;
}

/* Unlink i from its wheel bucket. */
static int wheel_remove(Core *c, int32_t i) {
    int32_t n = WNEXT(c, i), p = WPREV(c, i), b = F(c, i, int32_t, d_wbucket);
    if (!LINK_OK(c, n) || !LINK_OK(c, p) || (p == NIL && (b < 0 || b >= c->wheel_ticks)))
        return corrupt("wheel entry", i);
    if (p == NIL) c->wheel_head[b] = n;
    else WNEXT(c, p) = n;
    if (n != NIL) WPREV(c, n) = p;
    WNEXT(c, i) = WPREV(c, i) = NIL;
    return 0;
}

/* Finish i: done_ns, push on the done stack (linked through rnext), then the state. */
static void finish(Core *c, int32_t i, uint8_t state, int64_t now) {
    F(c, i, int64_t, d_done_ns) = now;
    RNEXT(c, i) = *c->h_done_head;
    PUBLISH(c->h_done_head, i);
    PUBLISH(&STATE(c, i), state);
}

#define CORE_OPEN(c)                                                        \
    if (!(c)->base) {                                                       \
        PyErr_SetString(PyExc_ValueError, "the queue's buffer was closed"); \
        return NULL;                                                        \
    }

static int index_ok(Core *c, long i) {
    if (i >= 0 && i < c->slots) return 1;
    PyErr_Format(PyExc_IndexError, "descriptor %ld out of range", i);
    return 0;
}

/* ------------------------------------------------ the main process's free list, handles
 * FREE descriptors waiting to be reserved, oldest freed first: a ring of `slots` entries in
 * this process's memory (only the main process moves descriptors to or from FREE, so no
 * lock). It is a hint checked on use, never trusted: an entry whose descriptor is no longer
 * FREE is skipped, a push onto a full ring is dropped, and an empty ring is refilled by a
 * scan of the table for FREE descriptors in index order. Whatever was pushed, reserve hands
 * out only FREE descriptors, each marked WRITTEN before the call returns, so never one twice
 * between two frees, and never fails while one is FREE. */
static void free_push(Core *c, int32_t i) {
    if (c->free_len >= c->slots) return;
    c->free_ring[(c->free_head + c->free_len) % c->slots] = i;
    c->free_len++;
}

static int32_t free_pop(Core *c) {
    for (;;) {
        if (!c->free_len) {
            for (Py_ssize_t i = 0; i < c->slots; i++)
                if (STATE(c, i) == FREE) free_push(c, (int32_t)i);
            if (!c->free_len) return NIL;
        }
        int32_t i = c->free_ring[c->free_head];
        c->free_head = (c->free_head + 1) % c->slots;
        c->free_len--;
        if (STATE(c, i) == FREE) return i;
    }
}

/* records.Handle(i, generation) (a plain tuple without a handle type). */
static PyObject *make_handle(Core *c, int32_t i) {
    return new_handle(c->handle, PyLong_FromLong(i),
                      PyLong_FromUnsignedLong(F(c, i, uint32_t, d_generation)));
}

/* ------------------------------------------------------- critical sections (lock held) */
static PyObject *submit_body(Core *c, long i) {
    if (!index_ok(c, i)) return NULL;
    F(c, i, uint32_t, d_attempt) = 0;
    F(c, i, int64_t, d_claim_ns) = 0;
    *c->h_seq += 1;
    SEQ(c, i) = *c->h_seq;
    if (ready_push(c, (int32_t)i) < 0) return NULL;
    wheel_insert(c, (int32_t)i);
    if (reach(c, "submit.linked") < 0) return NULL;
    PUBLISH(&STATE(c, i), QUEUED);
    uint64_t mask = *c->h_waiting;
    if (!mask) return PyLong_FromLong(-1);
    *c->h_waiting = mask & (mask - 1); /* wake the lowest waiting slot */
    return PyLong_FromLong(__builtin_ctzll(mask));
}

/* What records.Claim holds, for descriptor i just CLAIMED:
 * (index, generation, request_id, priority, deadline_ns, height, width, want_mask,
 *  enqueue_ns, part_class, claim_ns, attempt). */
static PyObject *claim_tuple(Core *c, int32_t i) {
    return Py_BuildValue(
        "(ikKiLIINLiLk)", (int)i, (unsigned long)F(c, i, uint32_t, d_generation),
        (unsigned long long)F(c, i, uint64_t, d_request_id), (int)F(c, i, uint8_t, d_priority),
        (long long)DEADLINE(c, i), (unsigned)F(c, i, uint32_t, d_height),
        (unsigned)F(c, i, uint32_t, d_width), PyBool_FromLong(F(c, i, uint8_t, d_want_mask)),
        (long long)F(c, i, int64_t, d_enqueue_ns), (int)F(c, i, int32_t, d_part_class),
        (long long)F(c, i, int64_t, d_claim_ns), (unsigned long)F(c, i, uint32_t, d_attempt));
}

/* Claim up to max_n in scheduling order. A request whose deadline is <= now + lead is not
 * started (it could not finish in time: lead is the batch's expected compute) but finished
 * EXPIRED, answered TIMEOUT. */
static PyObject *claim_body(Core *c, long slot, long pid, long max_n, long long now,
                            long long lead) {
    if (slot < 0 || slot >= c->max_workers) return PyErr_Format(PyExc_IndexError, "slot %ld", slot);
    if (W(c, slot, uint8_t, w_state) != ACTIVE || W(c, slot, int32_t, w_pid) != pid) Py_RETURN_NONE;
    PyObject *claimed = PyList_New(0);
    long expired = 0;
    while (claimed && PyList_GET_SIZE(claimed) < max_n) {
        int32_t i = ready_best(c);
        if (i == NIL) break;
        if (!LINK_OK(c, i)) goto fail_corrupt;
        if (ready_remove(c, i) < 0 || wheel_remove(c, i) < 0 || reach(c, "claim.unlinked") < 0)
            goto fail;
        if (DEADLINE(c, i) <= now + lead) {
            finish(c, i, EXPIRED, now);
            expired++;
            continue;
        }
        F(c, i, int32_t, d_worker) = (int32_t)slot;
        F(c, i, int32_t, d_worker_pid) = (int32_t)pid;
        F(c, i, int64_t, d_claim_ns) = now;
        F(c, i, uint32_t, d_attempt) += 1;
        PUBLISH(&STATE(c, i), CLAIMED);
        if (reach(c, "claim.marked") < 0) goto fail;
        PyObject *item = claim_tuple(c, i);
        if (!item || PyList_Append(claimed, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    if (expired) *c->h_expired += (uint64_t)expired;
    if (!claimed) return NULL;
    if (PyList_GET_SIZE(claimed)) { /* this worker's own counters */
        W(c, slot, uint64_t, w_batches) += 1;
        W(c, slot, uint64_t, w_requests) += (uint64_t)PyList_GET_SIZE(claimed);
    }
    return Py_BuildValue("(Nl)", claimed, expired);
fail_corrupt:
    corrupt("ready head", ready_best(c));
fail:
    if (expired) *c->h_expired += (uint64_t)expired;
    Py_XDECREF(claimed);
    return NULL;
}

/* The claim is still this worker's (state, generation, attempt, slot, pid); racy unless
 * the lock is held, which is how complete() uses it to skip writing a stale result. */
static int owns(Core *c, long i, unsigned long generation, unsigned long attempt, long slot,
                long pid) {
    return STATE(c, i) == CLAIMED && F(c, i, uint32_t, d_generation) == generation &&
           F(c, i, uint32_t, d_attempt) == attempt && F(c, i, int32_t, d_worker) == slot &&
           F(c, i, int32_t, d_worker_pid) == pid;
}

static PyObject *Core_owns(Core *c, PyObject *args) {
    CORE_OPEN(c);
    long i, slot, pid;
    unsigned long generation, attempt;
    if (!PyArg_ParseTuple(args, "lkkll", &i, &generation, &attempt, &slot, &pid)) return NULL;
    if (!index_ok(c, i)) return NULL;
    return PyBool_FromLong(owns(c, i, generation, attempt, slot, pid));
}

static PyObject *complete_body(Core *c, long i, unsigned long generation,
                               unsigned long attempt, long slot, long pid, long long now) {
    if (!index_ok(c, i)) return NULL;
    if (!owns(c, i, generation, attempt, slot, pid)) Py_RETURN_FALSE;
    finish(c, (int32_t)i, DONE, now);
    if (reach(c, "complete.flipped") < 0) return NULL;
    Py_RETURN_TRUE;
}

/* What a Completion needs of finished descriptor i, read before it is freed:
 * (index, generation, state, abandoned, request_id, conn_id, enqueue_ns, part_class, height,
 *  width, priority, kills, claim_ns, done_ns, worker). */
static PyObject *finished_tuple(Core *c, int32_t i) {
    return Py_BuildValue(
        "(ikiiKKLiIIiiLLi)", (int)i, (unsigned long)F(c, i, uint32_t, d_generation),
        (int)STATE(c, i), (int)F(c, i, uint8_t, d_abandoned),
        (unsigned long long)F(c, i, uint64_t, d_request_id),
        (unsigned long long)F(c, i, uint64_t, d_conn_id), (long long)F(c, i, int64_t, d_enqueue_ns),
        (int)F(c, i, int32_t, d_part_class), (unsigned)F(c, i, uint32_t, d_height),
        (unsigned)F(c, i, uint32_t, d_width), (int)F(c, i, uint8_t, d_priority),
        (int)F(c, i, uint8_t, d_kills), (long long)F(c, i, int64_t, d_claim_ns),
        (long long)F(c, i, int64_t, d_done_ns), (int)F(c, i, int32_t, d_worker));
}

/* Pop the whole done stack, oldest first, as finished_tuple()s, and free each descriptor
 * in the same hold (so a repair cannot push it again): generation += 1 (every old handle is
 * stale from here on), worker = NIL, then state = FREE, as core.py's make_free does, and
 * onto the free list. The result rows stay as they are: only the main process reuses a FREE
 * descriptor. */
static PyObject *collect_body(Core *c) {
    Py_ssize_t n = 0;
    for (int32_t i = *c->h_done_head; i != NIL; i = RNEXT(c, i))
        if (!LINK_OK(c, i) || ++n > c->slots) return corrupt("done stack", i), NULL;
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    Py_ssize_t k = n;
    for (int32_t i = *c->h_done_head; i != NIL; i = RNEXT(c, i)) {
        PyObject *item = finished_tuple(c, i);
        if (!item) return Py_DECREF(out), NULL;
        PyList_SET_ITEM(out, --k, item);
    }
    int32_t i = *c->h_done_head;
    PUBLISH(c->h_done_head, NIL);
    while (i != NIL) {
        int32_t next = RNEXT(c, i);
        F(c, i, uint32_t, d_generation) += 1;
        F(c, i, int32_t, d_worker) = NIL;
        PUBLISH(&STATE(c, i), FREE);
        i = next;
    }
    for (k = 0; k < n; k++) /* onto the free list, oldest first */
        free_push(c, (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(PyList_GET_ITEM(out, k), 0)));
    return out;
}

/* ---------------------------------------------- the four operations, locking themselves
 * Each takes `held` first. held = 0: trylock here, run the body, unlock — the uncontended
 * fast path, no Python between lock and unlock. If the trylock fails the body does not run
 * and the op returns a Contended sentinel: BUSY (someone holds it; nothing is held now) or
 * OWNER_DIED (EOWNERDEAD: the lock IS held now, inconsistent). Python then takes its slow
 * path (ipc/core.py QueueCore.contended: wait watching for a stuck holder, or repair →
 * consistent) and calls the op again with held = 1 (the caller holds the lock; no locking
 * here). */
static PyObject *BUSY, *OWNER_DIED;

static PyObject *enter(Core *c, int held) {
    if (held) return NULL;
    int rc = pthread_mutex_trylock(c->mutex);
    if (rc == 0) return NULL;
    return Py_NewRef(rc == EOWNERDEAD ? OWNER_DIED : BUSY); /* other errors: Python reports */
}

static PyObject *leave(Core *c, int held, PyObject *result) {
    int rc = held ? 0 : pthread_mutex_unlock(c->mutex);
    if (rc && result) {
        Py_DECREF(result);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return result;
}

#define LOCKED(c, held, body)              \
    do {                                    \
        PyObject *busy_ = enter(c, held);   \
        if (busy_) return busy_;            \
        return leave(c, held, body);        \
    } while (0)

static PyObject *Core_submit(Core *c, PyObject *args) {
    CORE_OPEN(c);
    int held;
    long i;
    if (!PyArg_ParseTuple(args, "pl", &held, &i)) return NULL;
    LOCKED(c, held, submit_body(c, i));
}

/* A request field given by the caller, as an integer in [lo, hi]; ValueError naming the
 * field otherwise (a non-integer too), so that nothing is written. u64 fields come back in
 * *u, the others in *v. */
static int field_value(PyObject *o, const char *name, int is_u64, long long lo, long long hi,
                       long long *v, unsigned long long *u) {
    PyObject *n = PyNumber_Index(o);
    int ok = n != NULL;
    if (ok && is_u64) {
        *u = PyLong_AsUnsignedLongLong(n);
        ok = !(*u == (unsigned long long)-1 && PyErr_Occurred());
    } else if (ok) {
        *v = PyLong_AsLongLong(n);
        ok = !(*v == -1 && PyErr_Occurred()) && *v >= lo && *v <= hi;
    }
    Py_XDECREF(n);
    if (ok) return 0;
    PyErr_Clear();
    if (is_u64)
        PyErr_Format(PyExc_ValueError, "request field %s out of range (u64): %R", name, o);
    else
        PyErr_Format(PyExc_ValueError, "request field %s out of range (%lld..%lld): %R", name,
                     lo, hi, o);
    return -1;
}

/* The acceptor's one call per request: write a WRITTEN descriptor's request block (what
 * layout.REQUEST_FIELDS spans; enqueue_ns is now) and submit it. Everything is checked
 * before a byte is written: a handle that names no descriptor's WRITTEN generation returns
 * None (the caller raises StaleHandle with the details), a value outside its field's range
 * raises ValueError. Then as submit(): the worker slot to wake or -1, or a Contended
 * sentinel with the block written (the caller submits on the slow path).
 * Arguments: (index, generation, request_id, conn_id, deadline_ns, part_class, height,
 * width, priority, want_mask, region, region_gen, region_offset); region is the region
 * table row + 1, 0 for the input slot. */
static PyObject *Core_submit_request(Core *c, PyObject *args) {
    CORE_OPEN(c);
    long i;
    unsigned long generation;
    PyObject *o[11];
    if (!PyArg_ParseTuple(args, "lkOOOOOOOOOOO", &i, &generation, &o[0], &o[1], &o[2], &o[3],
                          &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10]))
        return NULL;
    if (i < 0 || i >= c->slots || F(c, i, uint32_t, d_generation) != (uint32_t)generation ||
        generation > UINT32_MAX || STATE(c, i) != WRITTEN)
        Py_RETURN_NONE;
    static const char *names[] = {"request_id", "conn_id", "deadline_ns", "part_class",
                                  "height", "width", "priority", "want_mask", "region",
                                  "region_gen", "region_offset"};
    static const int is_u64[] = {1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    static const long long lo[] = {0, 0, LLONG_MIN, INT32_MIN, 0, 0, 0, 0, 0, 0, 0};
    static const long long hi[] = {0, 0, LLONG_MAX, INT32_MAX, UINT32_MAX, UINT32_MAX,
                                   PRIORITIES - 1, 1, UINT32_MAX, UINT32_MAX, 0};
    long long v[11] = {0};
    unsigned long long u[11] = {0};
    for (int k = 0; k < 11; k++) {
        if (k == 7) { /* want_mask: any truth value, as a flag */
            int flag = PyObject_IsTrue(o[k]);
            if (flag < 0) return NULL;
            v[k] = flag;
        } else if (field_value(o[k], names[k], is_u64[k], lo[k], hi[k], &v[k], &u[k]) < 0) {
            return NULL;
        }
    }
    uint64_t request_id = u[0], conn_id = u[1], offset = u[10];
    int64_t deadline_ns = v[2];
    F(c, i, uint64_t, d_request_id) = request_id;
    F(c, i, uint64_t, d_conn_id) = conn_id;
    F(c, i, int64_t, d_enqueue_ns) = now_ns();
    F(c, i, int64_t, d_deadline_ns) = deadline_ns;
    F(c, i, int32_t, d_part_class) = (int32_t)v[3];
    F(c, i, uint32_t, d_height) = (uint32_t)v[4];
    F(c, i, uint32_t, d_width) = (uint32_t)v[5];
    F(c, i, uint8_t, d_priority) = (uint8_t)v[6];
    F(c, i, uint8_t, d_want_mask) = (uint8_t)v[7];
    F(c, i, uint8_t, d_abandoned) = 0;
    F(c, i, uint8_t, d_kills) = 0;
    F(c, i, uint32_t, d_region) = (uint32_t)v[8];
    F(c, i, uint32_t, d_region_gen) = (uint32_t)v[9];
    F(c, i, uint64_t, d_region_offset) = offset;
    LOCKED(c, 0, submit_body(c, i));
}

static PyObject *Core_claim(Core *c, PyObject *args) {
    CORE_OPEN(c);
    int held;
    long slot, pid, max_n;
    long long now, lead = 0;
    if (!PyArg_ParseTuple(args, "plllL|L", &held, &slot, &pid, &max_n, &now, &lead)) return NULL;
    if (lead < 0) return PyErr_Format(PyExc_ValueError, "lead %lld is negative", lead);
    LOCKED(c, held, claim_body(c, slot, pid, max_n, now, lead));
}

static PyObject *Core_complete(Core *c, PyObject *args) {
    CORE_OPEN(c);
    int held;
    long i, slot, pid;
    unsigned long generation, attempt;
    long long now;
    if (!PyArg_ParseTuple(args, "plkkllL", &held, &i, &generation, &attempt, &slot, &pid, &now))
        return NULL;
    LOCKED(c, held, complete_body(c, i, generation, attempt, slot, pid, now));
}

static PyObject *Core_collect(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    int held = PyObject_IsTrue(arg);
    if (held < 0) return NULL;
    LOCKED(c, held, collect_body(c));
}

/* ------------------------------------------- index steps Python calls (lock held there)
 * The rest of the queue (expire_due, reclaim_worker, abandon_connection, oldest_ready,
 * next_deadline_ns and the repair, all in ipc/) runs in Python under the mutex and calls
 * these, so the ready lists and the wheel have this one implementation. */

static int32_t arg_index(Core *c, PyObject *arg) {
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NIL;
    return index_ok(c, i) ? (int32_t)i : NIL;
}

/* Link descriptor i into its ready list and its wheel bucket (a requeue, a repair). */
static PyObject *Core_link(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    int32_t i = arg_index(c, arg);
    if (i == NIL || ready_push(c, i) < 0) return NULL;
    wheel_insert(c, i);
    Py_RETURN_NONE;
}

/* Unlink descriptor i from its ready list and its wheel bucket. */
static PyObject *Core_unlink(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    int32_t i = arg_index(c, arg);
    if (i == NIL || ready_remove(c, i) < 0 || wheel_remove(c, i) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Unlink (wheel and ready list) and return every queued descriptor whose deadline is
 * <= now, visiting only the buckets from the cursor to now's tick (all of them after a gap
 * longer than a revolution), comparing each entry's exact deadline (rounds); then the
 * cursor moves to now's tick, which may still hold later deadlines. */
static PyObject *Core_expire(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    long long now = PyLong_AsLongLong(arg);
    if (now == -1 && PyErr_Occurred()) return NULL;
    PyObject *due = PyList_New(0);
    int64_t start = *c->h_wheel_cursor, now_tick = tick_of(c, now);
    if (!due || now_tick < start) return due;
    int64_t span = now_tick - start + 1 < c->wheel_ticks ? now_tick - start + 1 : c->wheel_ticks;
    for (int64_t k = 0; k < span; k++) {
        int64_t b = (start + k) % c->wheel_ticks;
        int32_t i = c->wheel_head[b < 0 ? b + c->wheel_ticks : b];
        for (Py_ssize_t hops = 0; i != NIL;) {
            if (!LINK_OK(c, i) || ++hops > c->slots)
                return corrupt("wheel link", i), Py_DECREF(due), NULL;
            int32_t after = WNEXT(c, i);
            if (DEADLINE(c, i) <= now) {
                PyObject *index = PyLong_FromLong(i);
                if (!index || wheel_remove(c, i) < 0 || ready_remove(c, i) < 0 ||
                    PyList_Append(due, index) < 0)
                    return Py_XDECREF(index), Py_DECREF(due), NULL;
                Py_DECREF(index);
            }
            i = after;
        }
    }
    *c->h_wheel_cursor = now_tick;
    return due;
}

/* The descriptor a claim would take next, or NIL. */
static PyObject *Core_best(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    return PyLong_FromLong(ready_best(c));
}

/* The earliest deadline among queued descriptors (each list's head is its minimum), or None. */
static PyObject *Core_earliest_deadline(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    int found = 0;
    int64_t earliest = 0;
    for (int p = 0; p < PRIORITIES; p++) {
        int32_t i = c->ready_head[p];
        if (!c->ready_count[p]) continue;
        if (!LINK_OK(c, i) || i == NIL) return corrupt("ready head", i), NULL;
        if (!found || DEADLINE(c, i) < earliest) earliest = DEADLINE(c, i);
        found = 1;
    }
    if (!found) Py_RETURN_NONE;
    return PyLong_FromLongLong(earliest);
}

/* Finish descriptor i as DONE, EXPIRED or FAILED at now: done_ns, push on the done stack,
 * then the state (finish()). reclaim_worker's expired and quarantined claims. */
static PyObject *Core_finish(Core *c, PyObject *args) {
    CORE_OPEN(c);
    long i;
    int state;
    long long now;
    if (!PyArg_ParseTuple(args, "liL", &i, &state, &now) || !index_ok(c, i)) return NULL;
    if (state < DONE || state > FAILED) return PyErr_Format(PyExc_ValueError, "state %d", state);
    finish(c, (int32_t)i, (uint8_t)state, now);
    Py_RETURN_NONE;
}

/* What collect() returns for finished descriptor i (expire_due builds its Completions). */
static PyObject *Core_finished(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    int32_t i = arg_index(c, arg);
    return i == NIL ? NULL : finished_tuple(c, i);
}

/* Forget every ready list and wheel bucket, then link `order` (the QUEUED descriptors; in
 * (deadline, seq) order each push is O(1)). Repair after a dead lock holder. */
static PyObject *Core_rebuild(Core *c, PyObject *order) {
    CORE_OPEN(c);
    PyObject *seq = PySequence_Fast(order, "rebuild() takes a sequence of descriptors");
    if (!seq) return NULL;
    for (int p = 0; p < PRIORITIES; p++) c->ready_head[p] = c->ready_tail[p] = NIL;
    for (int p = 0; p < PRIORITIES; p++) c->ready_count[p] = 0;
    for (Py_ssize_t b = 0; b < c->wheel_ticks; b++) c->wheel_head[b] = NIL;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
        int32_t i = arg_index(c, PySequence_Fast_GET_ITEM(seq, k));
        if (i == NIL || ready_push(c, i) < 0) return Py_DECREF(seq), NULL;
        wheel_insert(c, i);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------- lock-free reads and spins */

static long ready_total(Core *c) {
    long total = 0;
    for (int p = 0; p < PRIORITIES; p++) total += __atomic_load_n(&c->ready_count[p], __ATOMIC_RELAXED);
    return total;
}

static int done_waiting(Core *c) {
    return __atomic_load_n(c->h_done_head, __ATOMIC_RELAXED) != NIL;
}

static PyObject *Core_ready_total(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    return PyLong_FromLong(ready_total(c));
}

/* Admission's look at the load, lock-free (each count a relaxed snapshot, as in Python):
 * (queued at priority >= p, queued in all, ACTIVE workers). One call per request, so the
 * three counts are one C loop each, not three numpy reductions. */
static PyObject *Core_load_ahead(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    long p = PyLong_AsLong(arg);
    if (p == -1 && PyErr_Occurred()) return NULL;
    if (p < 0 || p >= PRIORITIES) return PyErr_Format(PyExc_ValueError, "priority %ld", p);
    long ahead = 0, total = 0, active = 0;
    for (int q = 0; q < PRIORITIES; q++) {
        long n = __atomic_load_n(&c->ready_count[q], __ATOMIC_RELAXED);
        total += n;
        if (q >= p) ahead += n;
    }
    for (Py_ssize_t s = 0; s < c->max_workers; s++)
        active += __atomic_load_n(&W(c, s, uint8_t, w_state), __ATOMIC_RELAXED) == ACTIVE;
    return Py_BuildValue("(lll)", ahead, total, active);
}

/* reserve(keep=0): a FREE descriptor, now WRITTEN and the caller's, as a Handle; None when
 * no more than `keep` descriptors are FREE (admission's reserved share: a request that may
 * not take the last `keep` gets none of them) or none is. Main process only. */
static PyObject *Core_reserve(Core *c, PyObject *args) {
    CORE_OPEN(c);
    Py_ssize_t keep = 0;
    if (!PyArg_ParseTuple(args, "|n", &keep)) return NULL;
    if (keep < 0) return PyErr_Format(PyExc_ValueError, "keep %zd is negative", keep);
    if (keep > 0) { /* more than keep FREE? the scan stops at keep + 1 */
        Py_ssize_t n = 0;
        for (Py_ssize_t i = 0; i < c->slots && n <= keep; i++) n += STATE(c, i) == FREE;
        if (n <= keep) Py_RETURN_NONE;
    }
    int32_t i = free_pop(c);
    if (i == NIL) Py_RETURN_NONE;
    PUBLISH(&STATE(c, i), WRITTEN);
    return make_handle(c, i);
}

/* Descriptor i was just made FREE (Python's make_free): onto the free list. */
static PyObject *Core_push_free(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    int32_t i = arg_index(c, arg);
    if (i == NIL) return NULL;
    free_push(c, i);
    Py_RETURN_NONE;
}

/* FREE descriptors now (a lock-free snapshot: only the main process frees or reserves). */
static PyObject *Core_free_count(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < c->slots; i++)
        n += __atomic_load_n(&STATE(c, i), __ATOMIC_RELAXED) == FREE;
    return PyLong_FromSsize_t(n);
}

/* Spin (GIL released, pause between looks) until ready_total >= min_ready (min_ready > 0)
 * or, with min_ready == 0, until the done stack is non-empty; at most spin_ns. */
#define ESCAPE_EVERY_NS 10000000 /* 10 ms */

static int spin(Core *c, long min_ready, int64_t spin_ns) {
    int found = 0;
    /* Each side publishes the CPU it spins on (header worker_cpu / main_cpu) and gives its
     * CPU away (sched_yield) between looks only when the other side was last seen on the
     * same CPU, or was never seen (-1: e.g. the daemon's main process, which never spins):
     * then the process we wait for may be queued behind us. On its own CPU we keep ours:
     * a yield there only hands it to unrelated work for a scheduler slice (milliseconds).
     *
     * Two processes handing over by yields stay on one CPU for good: each ran microseconds
     * ago, so load balancing never moves either ("cache hot"). So a worker that finds the
     * main process spinning on its CPU stops spinning (at most once per ESCAPE_EVERY_NS)
     * and sleeps on its eventfd: the wake-up lets the kernel place it on an idle CPU. */
    int32_t *mine = min_ready ? c->h_worker_cpu : c->h_main_cpu;
    int32_t *peer = min_ready ? c->h_main_cpu : c->h_worker_cpu;
    c->spinning++; /* GIL held: a plain counter is enough */
    Py_BEGIN_ALLOW_THREADS
    int64_t end = now_ns() + spin_ns;
    for (;;) {
        found = min_ready ? ready_total(c) >= min_ready : done_waiting(c);
        if (found || now_ns() >= end) break;
        int cpu = sched_getcpu();
        if (__atomic_load_n(mine, __ATOMIC_RELAXED) != cpu) /* a store per look would bounce */
            __atomic_store_n(mine, cpu, __ATOMIC_RELAXED);  /* the line under the other side */
        int32_t other = __atomic_load_n(peer, __ATOMIC_RELAXED);
        if (min_ready && other == cpu) {
            int64_t now = now_ns();
            if (now >= c->next_escape_ns) {
                c->next_escape_ns = now + ESCAPE_EVERY_NS;
                break;
            }
        }
        if (other < 0 || other == cpu) /* it cannot run while we pause: hand over at once */
            sched_yield();
        else
            for (int k = 0; k < 8; k++) CPU_RELAX();
    }
    Py_END_ALLOW_THREADS
    c->spinning--;
    return found;
}

static PyObject *Core_spin_ready(Core *c, PyObject *args) {
    CORE_OPEN(c);
    long min_ready;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "lL", &min_ready, &spin_ns)) return NULL;
    /* min_ready < 1 is met at once; it must not reach spin(), where 0 means the done stack */
    if (min_ready < 1 || ready_total(c) >= min_ready) Py_RETURN_TRUE;
    return PyBool_FromLong(spin_ns > 0 && spin(c, min_ready, spin_ns));
}

/* Main process: spin up to spin_ns for the done stack with completion_armed = 0 (workers
 * skip the eventfd), then re-arm and look once more (seq_cst store, then load: a worker
 * that pushed after this look sees armed = 1 and rings). True: the stack is non-empty. */
static PyObject *Core_await_done(Core *c, PyObject *arg) {
    CORE_OPEN(c);
    long long spin_ns = PyLong_AsLongLong(arg);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    if (done_waiting(c)) Py_RETURN_TRUE;
    int found = 0;
    if (spin_ns > 0) {
        __atomic_store_n(c->h_completion_armed, 0, __ATOMIC_RELAXED);
        found = spin(c, 0, spin_ns);
        __atomic_store_n(c->h_completion_armed, 1, __ATOMIC_SEQ_CST);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyBool_FromLong(found || done_waiting(c));
}

/* The daemon's event loop, which never spins: quiet() while it is awake and will look at
 * the done stack before it next sleeps (workers skip the eventfd meanwhile); rearm() just
 * before that sleep: armed = 1 (seq_cst), then one look, True if the stack is non-empty.
 * A worker that pushed after the look sees armed = 1 and rings (the handshake of
 * await_done, without its spin). */
static PyObject *Core_quiet(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    __atomic_store_n(c->h_completion_armed, 0, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *Core_rearm(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    __atomic_store_n(c->h_completion_armed, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyBool_FromLong(done_waiting(c));
}

/* A worker, after pushing on the done stack and unlocking: must it ring the eventfd? */
static PyObject *Core_completion_armed(Core *c, PyObject *unused) {
    (void)unused;
    CORE_OPEN(c);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyBool_FromLong(__atomic_load_n(c->h_completion_armed, __ATOMIC_RELAXED) != 0);
}

static PyObject *Core_close(Core *c, PyObject *unused) {
    (void)unused;
    if (c->spinning) { /* it reads the mapping without the GIL: unmapping now would crash it */
        PyErr_SetString(PyExc_RuntimeError, "close() while another thread is waiting on the queue");
        return NULL;
    }
    if (c->base) {
        c->base = NULL;
        PyBuffer_Release(&c->view);
    }
    Py_CLEAR(c->fault);
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"submit", (PyCFunction)Core_submit, METH_VARARGS, "link a WRITTEN descriptor, QUEUED"},
    {"submit_request", (PyCFunction)Core_submit_request, METH_VARARGS,
     "write a WRITTEN descriptor's request block, then submit it"},
    {"claim", (PyCFunction)Core_claim, METH_VARARGS, "claim up to max_n in order"},
    {"complete", (PyCFunction)Core_complete, METH_VARARGS, "flip an owned claim to DONE"},
    {"owns", (PyCFunction)Core_owns, METH_VARARGS, "the claim is still this worker's"},
    {"collect", (PyCFunction)Core_collect, METH_O, "pop the done stack, FREE"},
    {"link", (PyCFunction)Core_link, METH_O, "ready list + wheel in (lock held)"},
    {"unlink", (PyCFunction)Core_unlink, METH_O, "ready list + wheel out (lock held)"},
    {"expire", (PyCFunction)Core_expire, METH_O, "unlink the due (lock held)"},
    {"best", (PyCFunction)Core_best, METH_NOARGS, "next to claim, or -1 (lock held)"},
    {"earliest_deadline", (PyCFunction)Core_earliest_deadline, METH_NOARGS, "(lock held)"},
    {"finish", (PyCFunction)Core_finish, METH_VARARGS, "push on the done stack (lock held)"},
    {"finished", (PyCFunction)Core_finished, METH_O, "collect()'s row for i (lock held)"},
    {"rebuild", (PyCFunction)Core_rebuild, METH_O, "re-link the QUEUED (lock held)"},
    {"ready_total", (PyCFunction)Core_ready_total, METH_NOARGS, "queued requests, racy"},
    {"load_ahead", (PyCFunction)Core_load_ahead, METH_O, "(ahead, queued, workers), racy"},
    {"free_count", (PyCFunction)Core_free_count, METH_NOARGS, "FREE descriptors, racy"},
    {"reserve", (PyCFunction)Core_reserve, METH_VARARGS, "a FREE descriptor, WRITTEN, or None"},
    {"push_free", (PyCFunction)Core_push_free, METH_O, "onto the free list (just made FREE)"},
    {"spin_ready", (PyCFunction)Core_spin_ready, METH_VARARGS, "spin for queued work"},
    {"await_done", (PyCFunction)Core_await_done, METH_O, "spin for the done stack, re-arm"},
    {"completion_armed", (PyCFunction)Core_completion_armed, METH_NOARGS, "ring needed?"},
    {"quiet", (PyCFunction)Core_quiet, METH_NOARGS, "workers skip the ring (loop awake)"},
    {"rearm", (PyCFunction)Core_rearm, METH_NOARGS, "workers ring again; done stack set?"},
    {"close", (PyCFunction)Core_close, METH_NOARGS, "release the buffer"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "scratchd.ipc._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

/* The type of the BUSY and OWNER_DIED sentinels. */
static PyTypeObject ContendedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "scratchd.ipc._native.Contended",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_doc = "why a native operation did not run: BUSY or OWNER_DIED",
};

/* ---------------------------------------------------------------------------- eventfd */
/* A doorbell's ring and drain without Python's exception for EAGAIN (hot path: no raise). */
static PyObject *eventfd_ring(PyObject *mod, PyObject *arg) {
    (void)mod;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    uint64_t one = 1;
    if (write((int)fd, &one, sizeof one) < 0 && errno != EAGAIN) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *eventfd_drain(PyObject *mod, PyObject *arg) {
    (void)mod;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    uint64_t count = 0;
    if (read((int)fd, &count, sizeof count) < 0) {
        if (errno == EAGAIN) return PyLong_FromLong(0);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(count);
}

/* -------------------------------------------------------------------- recv_into_exact */
/* recv_into_exact(fd, buf, timeout_ms, cancel, after=None) -> (received, why)
 *
 * Fill ``buf`` and then ``after`` (if given) from the stream socket ``fd``: recvmsg
 * (MSG_DONTWAIT, both buffers in one call) while bytes are there, poll(POLLIN) when none are,
 * until both are full (why = RECV_FULL), the peer has closed (RECV_EOF), ``timeout_ms`` has
 * passed (RECV_TIMEOUT), ``cancel[0]`` is non-zero (RECV_CANCELLED), or recvmsg/poll fails
 * (why = that errno, > 0). ``received`` counts the bytes written, ``buf``'s first, whatever
 * the reason; nothing is raised for the socket's errors (the caller's transport meets them
 * again). EINTR is retried. Nothing past the two buffers is read from the socket.
 *
 * The GIL is released from the first recvmsg to the last: the only state shared with other
 * threads is the buffers (the caller must not touch them until this returns) and ``cancel``,
 * which another thread sets and this one reads before every recvmsg and after every poll.
 * poll waits at most RECV_SLICE_MS at a time, so a cancel is seen within that even on a
 * silent socket. The buffers are held (exported) for the run: the caller keeps them alive. */
#define RECV_SLICE_MS 2
enum { RECV_FULL = 0, RECV_EOF = -1, RECV_TIMEOUT = -2, RECV_CANCELLED = -3 };

/* The part of iov[0..1] (lengths ``lens``) not yet filled after ``got`` bytes. */
static int unfilled(struct iovec *iov, char *const bases[2], const size_t lens[2], size_t got) {
    int n = 0;
    for (int k = 0; k < 2; k++) {
        if (got >= lens[k]) {
            got -= lens[k];
            continue;
        }
        iov[n].iov_base = bases[k] + got;
        iov[n].iov_len = lens[k] - got;
        got = 0;
        n++;
    }
    return n;
}

static int recv_until(int fd, char *const bases[2], const size_t lens[2], const uint8_t *stop,
                      int64_t deadline, size_t *got) {
    struct iovec iov[2];
    int parts;
    while ((parts = unfilled(iov, bases, lens, *got)) > 0) {
        if (__atomic_load_n(stop, __ATOMIC_ACQUIRE)) return RECV_CANCELLED;
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)parts};
        ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT);
        if (n > 0) {
            *got += (size_t)n;
            continue;
        }
        if (n == 0) return RECV_EOF;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
        int64_t left = deadline - now_ns();
        if (left <= 0) return RECV_TIMEOUT;
        int slice = left < RECV_SLICE_MS * 1000000LL ? (int)((left + 999999) / 1000000) : RECV_SLICE_MS;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int rc = poll(&pfd, 1, slice);
        if (rc < 0 && errno != EINTR) return errno;
        if (rc > 0 && (pfd.revents & POLLNVAL)) return EBADF;
        /* POLLHUP / POLLERR: the next recvmsg says which (0: EOF, -1: the error) */
    }
    return RECV_FULL;
}

static PyObject *recv_into_exact(PyObject *mod, PyObject *args) {
    (void)mod;
    int fd;
    long long timeout_ms;
    Py_buffer buf, cancel, after = {.buf = NULL, .obj = NULL, .len = 0};
    PyObject *after_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iw*Lw*|O", &fd, &buf, &timeout_ms, &cancel, &after_obj))
        return NULL;
    PyObject *result = NULL;
    if (after_obj != Py_None && PyObject_GetBuffer(after_obj, &after, PyBUF_WRITABLE) < 0)
        goto done;
    if (timeout_ms < 0 || cancel.len < 1) {
        PyErr_Format(PyExc_ValueError, "recv_into_exact: timeout_ms %lld must be >= 0 and cancel "
                     "at least one byte (got %zd)", timeout_ms, cancel.len);
        goto done;
    }
    char *const bases[2] = {(char *)buf.buf, (char *)after.buf};
    const size_t lens[2] = {(size_t)buf.len, (size_t)after.len};
    size_t got = 0;
    int why;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;
    why = recv_until(fd, bases, lens, (const uint8_t *)cancel.buf, deadline, &got);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(ni)", (Py_ssize_t)got, why);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&cancel);
    if (after.obj) PyBuffer_Release(&after);
    return result;
}

static PyMethodDef module_functions[] = {
    {"recv_into_exact", recv_into_exact, METH_VARARGS,
     "fill writable buffers from a socket, GIL released: (received, why)"},
    {"eventfd_ring", eventfd_ring, METH_O, "add 1 to a non-blocking eventfd (full: ignored)"},
    {"eventfd_drain", eventfd_drain, METH_O, "read and reset a non-blocking eventfd; 0 if unset"},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------ module */
static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, .m_name = "scratchd.ipc._native",
    .m_doc = "The queue's hot paths in C.", .m_size = -1, .m_methods = module_functions,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&MutexType) < 0 || PyType_Ready(&CoreType) < 0 ||
        PyType_Ready(&ContendedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m) return NULL;
    Py_INCREF(&MutexType);
    Py_INCREF(&CoreType);
    BUSY = PyObject_CallNoArgs((PyObject *)&ContendedType);
    OWNER_DIED = PyObject_CallNoArgs((PyObject *)&ContendedType);
    Py_INCREF(&ContendedType);
    if (!BUSY || !OWNER_DIED || PyModule_AddObject(m, "Mutex", (PyObject *)&MutexType) < 0 ||
        PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObject(m, "Contended", (PyObject *)&ContendedType) < 0 ||
        PyModule_AddObjectRef(m, "BUSY", BUSY) < 0 ||
        PyModule_AddObjectRef(m, "OWNER_DIED", OWNER_DIED) < 0 ||
        PyModule_AddIntConstant(m, "RECV_FULL", RECV_FULL) < 0 ||
        PyModule_AddIntConstant(m, "RECV_EOF", RECV_EOF) < 0 ||
        PyModule_AddIntConstant(m, "RECV_TIMEOUT", RECV_TIMEOUT) < 0 ||
        PyModule_AddIntConstant(m, "RECV_CANCELLED", RECV_CANCELLED) < 0 ||
        PyModule_AddIntConstant(m, "RECV_SLICE_MS", RECV_SLICE_MS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
