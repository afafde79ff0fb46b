/* uring.c: an io_uring ring for batched file reads and writes.
 *
 *   Uring(entries, punt_reads=False) - a ring that allows `entries` (1..4096)
 *                         requests in flight; punt_reads sends reads to io-wq
 *   submit(requests)    - each request is (op, fd, offset, buffer, tag); op 0 reads
 *                         into the buffer, op 1 writes it; all queued, one syscall.
 *                         A list or tuple of buffers is one vectored request
 *                         (READV/WRITEV: file-adjacent ranges of different
 *                         buffers in one I/O, as preadv)
 *   reap(min_complete=1) -> [(tag, result)]: waits for at least min_complete
 *                         completions and returns every one available; result is
 *                         the bytes moved (short at EOF) or -errno
 *   register_buffer(buffer) - pin one buffer (the staging ring) in the kernel
 *                         once; requests wholly inside it then use
 *                         READ_FIXED/WRITE_FIXED, which skip pinning its pages
 *                         per request (4 KiB shmem pages: about 13% of an
 *                         O_DIRECT write's time here)
 *   close(), fileno(), in_flight, entries
 *
 * Raw syscalls, not liburing: we need setup, one mmap per ring and enter, and a
 * build dependency for that is not worth it. IORING_OP_READ/WRITE need Linux 5.6;
 * the constructor probes for them, and raises OSError like a refused
 * io_uring_setup (seccomp, io_uring_disabled), so "auto" falls back to threads.
 * Every syscall runs with the GIL released (NKV_UNLOCKED). The Python side is
 * npukv_store/io/uring.py; its pure-Python twin is io/threads.py.
 *
 * Caveats:
 *   - close() and dealloc wait for every request in flight. A request that never
 *     completes (a read from an empty pipe) blocks them: the ring is for files.
 *   - After fork() the child must not touch the parent's ring (the rings are
 *     MAP_SHARED): there, methods raise RuntimeError, and dealloc only unmaps,
 *     closes its fd and drops its references.
 */
#define _GNU_SOURCE
#include "nkv.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#define NKV_URING_MAX_ENTRIES 4096
#define NKV_URING_READ 0
#define NKV_URING_WRITE 1
/* Linux moves at most this many bytes per read or write (MAX_RW_COUNT). Longer
 * buffers are clamped to it, which gives the same short count preadv gives and
 * keeps the 32-bit SQE length from wrapping; refusing them would differ from the
 * thread engine. */
#define NKV_MAX_RW_BYTES 0x7ffff000L
/* The kernel takes registered buffers of at most 1 GiB each: a longer one is
 * registered as consecutive pieces (at most NKV_FIXED_MAX_PIECES). */
#define NKV_FIXED_PIECE_BYTES (1UL << 30)
#define NKV_FIXED_MAX_PIECES 64

/* ---------------------------------------------------------------- structs */

/* One request between submit() and reap(). The kernel writes into (or reads
 * from) view.buf until its CQE is reaped, so the Py_buffer pins the exporter
 * until then. A request the kernel refused to take gets its -errno in `result`
 * and is listed in local_slots; the next reap() hands it out like a CQE. */
typedef struct {
    Py_buffer view; /* view.obj != NULL while the slot is in use */
    PyObject *tag;  /* owned reference */
    int result;     /* -errno of a refused request */
    /* A vectored request: view is its first buffer, more[0..num_more) the
     * others, iov all of them (PyMem; NULL for a plain request). */
    Py_buffer *more;
    Py_ssize_t num_more;
    struct iovec *iov;
} nkv_slot;

/* Invariants (all fields are written with the GIL held by the one thread that
 * holds `busy`, except the ring words noted below):
 *   - in_flight <= entries <= sq_entries and cq_entries = 2 * sq_entries, so the
 *     SQ never fills and the CQ never overflows;
 *   - when submit() returns the SQ is empty: the kernel consumed every SQE, or
 *     the ones it refused were taken back and became local results;
 *   - user_data of an SQE is its slot index; in_flight = slots in use.
 * Ring words shared with the kernel: *sq_head and *cq_tail are written by the
 * kernel (read with acquire); *sq_tail and *cq_head by us (release store, after
 * the SQEs are filled / after the CQEs are read). A stale read only means one
 * more io_uring_enter. */
typedef struct {
    PyObject_HEAD
    int fd;         /* ring fd; -1 once closed */
    pid_t pid;      /* creator; a forked child must not touch the rings */
    int busy;       /* 1 while a method runs; taken by atomic exchange */
    unsigned entries;
    int punt_reads; /* IOSQE_ASYNC on reads: cached-page copies on io-wq workers */
    unsigned in_flight;
    unsigned num_local; /* slots with local results, listed in local_slots */
    unsigned num_free;  /* free slot indices, a stack in free_slots */
    nkv_slot *slots;
    unsigned *free_slots;
    unsigned *local_slots;
    unsigned *sq_head, *sq_tail, *sq_array, sq_mask, sq_local_tail;
    struct io_uring_sqe *sqes;
    unsigned *cq_head, *cq_tail, cq_mask;
    struct io_uring_cqe *cqes;
    void *sq_ring, *cq_ring; /* the same mapping with IORING_FEAT_SINGLE_MMAP */
    size_t sq_ring_bytes, cq_ring_bytes, sqes_bytes;
    Py_buffer fixed;    /* the registered buffer; fixed.obj != NULL while held */
    unsigned long long fixed_submitted; /* requests sent as READ/WRITE_FIXED */
} nkv_uring;

/* ---------------------------------------------------------------- syscalls */

static int
nkv_sys_setup(unsigned entries, struct io_uring_params *params)
{
    return (int)syscall(__NR_io_uring_setup, entries, params);
}

static int
nkv_sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL,
                        0);
}

/* 0 when the kernel knows IORING_OP_READ and IORING_OP_WRITE, else an errno. */
static int
nkv_probe_ops(int fd)
{
    const unsigned num_ops = 256;
    struct io_uring_probe *probe =
        calloc(1, sizeof(*probe) + num_ops * sizeof(struct io_uring_probe_op));
    int err = 0;

    if (probe == NULL) {
        return ENOMEM;
    }
    if (syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, num_ops) <
        0) {
        err = errno == EINVAL ? ENOSYS : errno; /* EINVAL: before 5.6, no probe */
    } else if (probe->last_op < IORING_OP_WRITE ||
               !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
               !(probe->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED)) {
        err = ENOSYS;
    }
    free(probe);
    return err;
}

/* ---------------------------------------------------------------- ring memory */

static void *
nkv_map(int fd, size_t nbytes, off_t what)
{
    void *addr = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      fd, what);
    return addr == MAP_FAILED ? NULL : addr;
}

/* Map the rings of a fresh ring fd; 0 or an errno. */
static int
nkv_ring_map(nkv_uring *self, const struct io_uring_params *p)
{
    char *sq, *cq;

    self->sq_ring_bytes = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    self->cq_ring_bytes = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        if (self->cq_ring_bytes > self->sq_ring_bytes) {
            self->sq_ring_bytes = self->cq_ring_bytes;
        }
        self->cq_ring_bytes = self->sq_ring_bytes;
    }
    if ((self->sq_ring = nkv_map(self->fd, self->sq_ring_bytes, IORING_OFF_SQ_RING)) ==
        NULL) {
        return errno;
    }
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        self->cq_ring = self->sq_ring;
    } else if ((self->cq_ring = nkv_map(self->fd, self->cq_ring_bytes,
                                        IORING_OFF_CQ_RING)) == NULL) {
        return errno;
    }
    self->sqes_bytes = p->sq_entries * sizeof(struct io_uring_sqe);
    if ((self->sqes = nkv_map(self->fd, self->sqes_bytes, IORING_OFF_SQES)) == NULL) {
        return errno;
    }
    sq = self->sq_ring;
    cq = self->cq_ring;
    self->sq_head = (unsigned *)(sq + p->sq_off.head);
    self->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    self->sq_array = (unsigned *)(sq + p->sq_off.array);
    self->sq_mask = *(unsigned *)(sq + p->sq_off.ring_mask);
    self->sq_local_tail = *self->sq_tail;
    self->cq_head = (unsigned *)(cq + p->cq_off.head);
    self->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    self->cq_mask = *(unsigned *)(cq + p->cq_off.ring_mask);
    self->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    return 0;
}

static void
nkv_ring_unmap(nkv_uring *self)
{
    if (self->sqes != NULL) {
        munmap(self->sqes, self->sqes_bytes);
    }
    if (self->cq_ring != NULL && self->cq_ring != self->sq_ring) {
        munmap(self->cq_ring, self->cq_ring_bytes);
    }
    if (self->sq_ring != NULL) {
        munmap(self->sq_ring, self->sq_ring_bytes);
    }
    self->sqes = NULL;
    self->sq_ring = self->cq_ring = NULL;
}

/* ---------------------------------------------------------------- slots */

static unsigned
nkv_cq_ready(const nkv_uring *self)
{
    return __atomic_load_n(self->cq_tail, __ATOMIC_ACQUIRE) - *self->cq_head;
}

/* Unpin a slot's buffer and hand back its tag (a new reference to drop or to
 * store), putting the slot back on the free stack. */
static PyObject *
nkv_slot_free(nkv_uring *self, unsigned index)
{
    nkv_slot *slot = &self->slots[index];
    PyObject *tag = slot->tag;

    PyBuffer_Release(&slot->view);
    for (Py_ssize_t i = 0; i < slot->num_more; i++) {
        PyBuffer_Release(&slot->more[i]);
    }
    PyMem_Free(slot->more);
    PyMem_Free(slot->iov);
    slot->more = NULL;
    slot->iov = NULL;
    slot->num_more = 0;
    slot->tag = NULL;
    self->free_slots[self->num_free++] = index;
    self->in_flight--;
    return tag;
}

/* Drop every completion available now (close and dealloc). */
static void
nkv_discard_ready(nkv_uring *self)
{
    unsigned head = *self->cq_head;
    unsigned tail = __atomic_load_n(self->cq_tail, __ATOMIC_ACQUIRE);

    for (; head != tail; head++) {
        unsigned slot_index = (unsigned)self->cqes[head & self->cq_mask].user_data;

        Py_XDECREF(nkv_slot_free(self, slot_index));
    }
    __atomic_store_n(self->cq_head, head, __ATOMIC_RELEASE);
    for (unsigned i = 0; i < self->num_local; i++) {
        Py_XDECREF(nkv_slot_free(self, self->local_slots[i]));
    }
    self->num_local = 0;
}

/* Wait until every request in flight has completed, dropping the completions.
 * 0, or -1 with an exception set (a signal handler raised while interruptible,
 * or io_uring_enter failed; the ring is then left as it was). */
static int
nkv_drain(nkv_uring *self, int interruptible)
{
    while (self->in_flight > 0) {
        unsigned wanted = self->in_flight - self->num_local;
        int rc = 0;
        int err = 0;

        if (nkv_cq_ready(self) < wanted) {
            NKV_UNLOCKED(rc = nkv_sys_enter(self->fd, 0, wanted, IORING_ENTER_GETEVENTS);
                         if (rc < 0) err = errno);
        }
        if (rc < 0 && err == EINTR) {
            if (interruptible && PyErr_CheckSignals() < 0) {
                return -1;
            }
            continue;
        }
        if (rc < 0) {
            nkv_err_set("io_uring_enter", err);
            return -1;
        }
        nkv_discard_ready(self);
    }
    return 0;
}

/* ---------------------------------------------------------------- Uring */

/* Take the ring for one method call: RuntimeError if another thread is inside
 * a method (it may be in the kernel without the GIL) or after fork, ValueError
 * once closed. */
static int
nkv_uring_acquire(nkv_uring *self, const char *what)
{
    if (__atomic_exchange_n(&self->busy, 1, __ATOMIC_ACQUIRE)) {
        PyErr_Format(PyExc_RuntimeError, "Uring.%s: in use by another thread", what);
        return -1;
    }
    if (self->fd < 0) {
        PyErr_Format(PyExc_ValueError, "Uring.%s on a closed ring", what);
    } else if (self->pid != getpid()) {
        PyErr_Format(PyExc_RuntimeError,
                     "Uring.%s: the ring belongs to process %ld, found process %ld "
                     "(a forked child needs its own ring)",
                     what, (long)self->pid, (long)getpid());
    } else {
        return 0;
    }
    __atomic_store_n(&self->busy, 0, __ATOMIC_RELEASE);
    return -1;
}

static void
nkv_uring_release(nkv_uring *self)
{
    __atomic_store_n(&self->busy, 0, __ATOMIC_RELEASE);
}

/* Unmap and close; drops what is still pinned. Only when nothing is in flight
 * for the kernel (drained, or a forked child, whose requests are the parent's). */
static void
nkv_uring_teardown(nkv_uring *self)
{
    if (self->slots != NULL) {
        for (unsigned i = 0; i < self->entries; i++) {
            if (self->slots[i].view.obj != NULL) {
                Py_XDECREF(nkv_slot_free(self, i));
            }
        }
    }
    self->num_local = 0;
    nkv_ring_unmap(self);
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    /* Closing the ring fd unregisters the buffer; the kernel keeps its own page
     * references until then, so the exporter may go now. */
    if (self->fixed.obj != NULL) {
        PyBuffer_Release(&self->fixed);
    }
}

/* The slot table, all slots free; -1 when out of memory. */
static int
nkv_slots_alloc(nkv_uring *self)
{
    self->slots = PyMem_Calloc(self->entries, sizeof(nkv_slot));
    self->free_slots = PyMem_Calloc(self->entries, sizeof(unsigned));
    self->local_slots = PyMem_Calloc(self->entries, sizeof(unsigned));
    if (self->slots == NULL || self->free_slots == NULL || self->local_slots == NULL) {
        return -1;
    }
    for (unsigned i = 0; i < self->entries; i++) {
        self->free_slots[i] = self->entries - 1 - i;
    }
    self->num_free = self->entries;
    return 0;
}

static PyObject *
nkv_uring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"entries", "punt_reads", NULL};
    struct io_uring_params params;
    PyObject *entries_obj;
    Py_ssize_t entries;
    int punt_reads = 0;
    int fd;
    int err = 0;
    nkv_uring *self;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:Uring", kwlist, &entries_obj,
                                     &punt_reads)) {
        return NULL;
    }
    /* Any int: one past the range of a C int is a ValueError, not OverflowError
     * (NULL: clamped to the Py_ssize_t range) */
    entries = PyNumber_AsSsize_t(entries_obj, NULL);
    if (entries == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (entries < 1 || entries > NKV_URING_MAX_ENTRIES) {
        return PyErr_Format(PyExc_ValueError, "Uring: found %R entries, expected 1..%d",
                            entries_obj, NKV_URING_MAX_ENTRIES);
    }
    self = (nkv_uring *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) {
        return NULL;
    }
    self->fd = -1;
    self->pid = getpid();
    self->entries = (unsigned)entries;
    self->punt_reads = punt_reads;
    if (nkv_slots_alloc(self) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memset(&params, 0, sizeof(params));
    NKV_UNLOCKED(fd = nkv_sys_setup(self->entries, &params); if (fd < 0) err = errno);
    if (fd < 0) {
        Py_DECREF(self);
        return nkv_err_set("io_uring_setup", err);
    }
    self->fd = fd;
    NKV_UNLOCKED(err = nkv_probe_ops(fd));
    if (err != 0) {
        Py_DECREF(self);
        return nkv_err_set("io_uring IORING_OP_READ/WRITE (Linux >= 5.6)", err);
    }
    NKV_UNLOCKED(err = nkv_ring_map(self, &params));
    if (err != 0) {
        Py_DECREF(self);
        return nkv_err_set("io_uring mmap", err);
    }
    return (PyObject *)self;
}

static void
nkv_uring_dealloc(nkv_uring *self)
{
    PyTypeObject *type = Py_TYPE(self);
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *saved = PyErr_GetRaisedException();
#else
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
#endif

    if (self->fd >= 0 && self->pid == getpid() && nkv_drain(self, 0) < 0) {
        /* The kernel may still write into the pinned buffers: leak them rather
         * than free memory it owns. Only a broken ring fd gets here. */
        PyErr_WriteUnraisable((PyObject *)self);
        self->slots = NULL;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(saved);
#else
    PyErr_Restore(exc_type, exc_value, exc_tb);
#endif
    nkv_uring_teardown(self);
    PyMem_Free(self->slots);
    PyMem_Free(self->free_slots);
    PyMem_Free(self->local_slots);
    type->tp_free(self);
    Py_DECREF(type);
}

/* Pin the buffers of a vectored request (a list or tuple of 1..IOV_MAX
 * buffers) in `slot` and build its iovec array. 0, or -1 with an exception set
 * and nothing held. */
static int
nkv_slot_take_vector(nkv_slot *slot, PyObject *buffers, int op, Py_ssize_t index)
{
    int flags = op == NKV_URING_READ ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(buffers);
    Py_ssize_t got = 0;

    if (count < 1 || count > IOV_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "submit: request %zd has %zd buffers, expected 1..%d",
                     index, count, IOV_MAX);
        return -1;
    }
    slot->iov = PyMem_Calloc((size_t)count, sizeof(struct iovec));
    slot->more = count > 1 ? PyMem_Calloc((size_t)count - 1, sizeof(Py_buffer)) : NULL;
    if (slot->iov == NULL || (count > 1 && slot->more == NULL)) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; got < count; got++) {
        Py_buffer *view = got == 0 ? &slot->view : &slot->more[got - 1];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, got), view, flags) < 0) {
            goto fail;
        }
        slot->iov[got].iov_base = view->buf;
        slot->iov[got].iov_len = (size_t)view->len;
    }
    slot->num_more = count - 1;
    return 0;
fail:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(i == 0 ? &slot->view : &slot->more[i - 1]);
    }
    PyMem_Free(slot->iov);
    PyMem_Free(slot->more);
    slot->iov = NULL;
    slot->more = NULL;
    slot->num_more = 0;
    return -1;
}

/* Pin one (op, fd, offset, buffer, tag) request in a free slot and fill the
 * next SQE for it (not yet published). 0, or -1 with an exception set and the
 * slot still free. */
static int
nkv_prepare(nkv_uring *self, PyObject *request, Py_ssize_t index)
{
    int op, fd;
    long long offset;
    PyObject *buffer, *tag;
    unsigned slot_index, sq_index;
    nkv_slot *slot;
    struct io_uring_sqe *sqe;

    if (!PyTuple_Check(request)) {
        PyErr_Format(PyExc_TypeError,
                     "submit: request %zd is %.100s, expected a tuple "
                     "(op, fd, offset, buffer, tag)",
                     index, Py_TYPE(request)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(request, "iiLOO:submit", &op, &fd, &offset, &buffer, &tag)) {
        return -1;
    }
    if ((op != NKV_URING_READ && op != NKV_URING_WRITE) || offset < 0) {
        PyErr_Format(PyExc_ValueError,
                     "submit: request %zd has op %d and offset %lld, expected op 0 "
                     "(read) or 1 (write) and offset >= 0",
                     index, op, offset);
        return -1;
    }
    slot_index = self->free_slots[self->num_free - 1];
    slot = &self->slots[slot_index];
    int vectored = PyList_Check(buffer) || PyTuple_Check(buffer);
    if (vectored) {
        /* a tuple: a __buffer__ run while the views are taken cannot resize it */
        PyObject *buffers = PySequence_Tuple(buffer);
        int rc = buffers == NULL ? -1 : nkv_slot_take_vector(slot, buffers, op, index);
        Py_XDECREF(buffers);
        if (rc < 0) {
            return -1;
        }
    } else if (PyObject_GetBuffer(buffer, &slot->view,
                                  op == NKV_URING_READ ? PyBUF_WRITABLE
                                                       : PyBUF_SIMPLE) < 0) {
        return -1;
    }
    self->num_free--;
    self->in_flight++;
    Py_INCREF(tag);
    slot->tag = tag;
    sq_index = self->sq_local_tail++ & self->sq_mask;
    sqe = &self->sqes[sq_index];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = op == NKV_URING_READ ? IORING_OP_READ : IORING_OP_WRITE;
    if (vectored) {
        sqe->opcode = op == NKV_URING_READ ? IORING_OP_READV : IORING_OP_WRITEV;
    } else if (self->fixed.obj != NULL) {
        const char *base = (const char *)self->fixed.buf;
        const char *buf = (const char *)slot->view.buf;
        if (buf >= base && buf + slot->view.len <= base + self->fixed.len) {
            size_t piece = (size_t)(buf - base) / NKV_FIXED_PIECE_BYTES;
            size_t end = (size_t)(buf + slot->view.len - base);
            if (slot->view.len > 0 && (end - 1) / NKV_FIXED_PIECE_BYTES == piece) {
                sqe->opcode = op == NKV_URING_READ ? IORING_OP_READ_FIXED
                                                   : IORING_OP_WRITE_FIXED;
                sqe->buf_index = (unsigned short)piece;
                self->fixed_submitted++;
            }
        }
    }
    if (op == NKV_URING_READ && self->punt_reads) {
        /* Without it a read of cached pages is copied inline, inside
         * io_uring_enter on the caller's thread: one core for the whole batch. */
        sqe->flags = IOSQE_ASYNC;
    }
    sqe->fd = fd;
    sqe->off = (unsigned long long)offset;
    if (vectored) { /* the kernel clamps a vector's total to MAX_RW_COUNT */
        sqe->addr = (unsigned long long)(uintptr_t)slot->iov;
        sqe->len = (unsigned)(slot->num_more + 1);
    } else {
        sqe->addr = (unsigned long long)(uintptr_t)slot->view.buf;
        sqe->len = (unsigned)(slot->view.len < NKV_MAX_RW_BYTES ? slot->view.len
                                                                 : NKV_MAX_RW_BYTES);
    }
    sqe->user_data = slot_index;
    self->sq_array[sq_index] = sq_index;
    return 0;
}

/* Take back the last `count` SQEs filled, which the kernel has not consumed
 * (the caller publishes the new tail). With `err` their requests become local
 * results -err for the next reap(); without, their slots are freed. */
static void
nkv_unqueue(nkv_uring *self, unsigned count, int err)
{
    for (unsigned i = 0; i < count; i++) {
        unsigned sq_index = --self->sq_local_tail & self->sq_mask;
        unsigned slot_index = (unsigned)self->sqes[sq_index].user_data;

        if (err != 0) {
            self->slots[slot_index].result = -err;
            self->local_slots[self->num_local++] = slot_index;
        } else {
            Py_XDECREF(nkv_slot_free(self, slot_index));
        }
    }
}

/* Publish the `count` SQEs just filled and have the kernel consume them. Those
 * it refuses (EAGAIN, ENOMEM) are taken back off the SQ and become local
 * results -errno, as the thread engine reports a failed preadv: every accepted
 * request completes exactly once, and the SQ is left empty. */
static void
nkv_enter_all(nkv_uring *self, unsigned count)
{
    int err = 0;

    __atomic_store_n(self->sq_tail, self->sq_local_tail, __ATOMIC_RELEASE);
    while (count > 0) {
        int rc;

        err = 0;
        NKV_UNLOCKED(rc = nkv_sys_enter(self->fd, count, 0, 0); if (rc < 0) err = errno);
        if (rc > 0) {
            count -= (unsigned)rc;
        } else if (rc == 0 || err != EINTR) {
            break;
        }
    }
    if (count > 0) {
        nkv_unqueue(self, count, err != 0 ? err : EAGAIN);
        __atomic_store_n(self->sq_tail, self->sq_local_tail, __ATOMIC_RELEASE);
    }
}

static PyObject *
nkv_uring_submit(nkv_uring *self, PyObject *requests)
{
    PyObject *seq = NULL;
    PyObject *out = NULL;
    Py_ssize_t num_requests;
    Py_ssize_t prepared = 0;

    if (nkv_uring_acquire(self, "submit") < 0) {
        return NULL;
    }
    /* A copy: converting a request may run Python code that mutates a list. */
    if ((seq = PySequence_Tuple(requests)) == NULL) {
        goto done;
    }
    num_requests = PyTuple_GET_SIZE(seq);
    if (num_requests > (Py_ssize_t)(self->entries - self->in_flight)) {
        PyErr_Format(PyExc_ValueError,
                     "submit: found %u in flight + %zd new requests, expected at most "
                     "%u (the ring's entries); reap first",
                     self->in_flight, num_requests, self->entries);
        goto done;
    }
    for (; prepared < num_requests; prepared++) {
        if (nkv_prepare(self, PyTuple_GET_ITEM(seq, prepared), prepared) < 0) {
            nkv_unqueue(self, (unsigned)prepared, 0); /* all or none; unpublished */
            goto done;
        }
    }
    nkv_enter_all(self, (unsigned)num_requests);
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(seq);
    nkv_uring_release(self);
    return out;
}

/* Every completion available now as a list of (tag, result); nothing is
 * consumed unless the whole list could be built. */
static PyObject *
nkv_harvest(nkv_uring *self)
{
    unsigned head = *self->cq_head;
    unsigned num_cqes = nkv_cq_ready(self);
    unsigned total = num_cqes + self->num_local;
    PyObject *out = PyList_New((Py_ssize_t)total);

    if (out == NULL) {
        return NULL;
    }
    for (unsigned i = 0; i < total; i++) { /* everything fallible first */
        int result = i < num_cqes ? self->cqes[(head + i) & self->cq_mask].res
                                  : self->slots[self->local_slots[i - num_cqes]].result;
        PyObject *pair = PyTuple_New(2);
        PyObject *value = PyLong_FromLong(result);

        if (pair == NULL || value == NULL) {
            Py_XDECREF(pair);
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(pair, 1, value);
        PyList_SET_ITEM(out, i, pair);
    }
    for (unsigned i = 0; i < total; i++) {
        unsigned slot_index =
            i < num_cqes ? (unsigned)self->cqes[(head + i) & self->cq_mask].user_data
                         : self->local_slots[i - num_cqes];
        PyTuple_SET_ITEM(PyList_GET_ITEM(out, i), 0, nkv_slot_free(self, slot_index));
    }
    __atomic_store_n(self->cq_head, head + num_cqes, __ATOMIC_RELEASE);
    self->num_local = 0;
    return out;
}

static PyObject *
nkv_uring_reap(nkv_uring *self, PyObject *args)
{
    PyObject *min_obj = NULL;
    Py_ssize_t min_complete = 1;
    unsigned wanted;
    PyObject *out;

    if (!PyArg_ParseTuple(args, "|O:reap", &min_obj)) {
        return NULL;
    }
    /* Any int: more than is in flight waits for all of it, as the thread
     * engine does (NULL: clamped to the Py_ssize_t range) */
    if (min_obj != NULL) {
        min_complete = PyNumber_AsSsize_t(min_obj, NULL);
        if (min_complete == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (min_complete < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "reap: found min_complete %R, expected >= 0", min_obj);
    }
    if (nkv_uring_acquire(self, "reap") < 0) {
        return NULL;
    }
    wanted = (size_t)min_complete < self->in_flight ? (unsigned)min_complete
                                                    : self->in_flight;
    while (nkv_cq_ready(self) + self->num_local < wanted) {
        int rc;
        int err = 0;

        NKV_UNLOCKED(rc = nkv_sys_enter(self->fd, 0, wanted - self->num_local,
                                        IORING_ENTER_GETEVENTS);
                     if (rc < 0) err = errno);
        if (rc < 0 && (err != EINTR || PyErr_CheckSignals() < 0)) {
            /* completions stay in the CQ for the next reap */
            if (err != EINTR) {
                nkv_err_set("io_uring_enter", err);
            }
            nkv_uring_release(self);
            return NULL;
        }
    }
    out = nkv_harvest(self);
    nkv_uring_release(self);
    return out;
}

static PyObject *
nkv_uring_close(nkv_uring *self, PyObject *unused)
{
    (void)unused;
    if (self->fd < 0) {
        Py_RETURN_NONE; /* idempotent */
    }
    if (nkv_uring_acquire(self, "close") < 0) {
        return NULL;
    }
    if (nkv_drain(self, 1) < 0) {
        nkv_uring_release(self); /* still open and consistent: close() may be retried */
        return NULL;
    }
    nkv_uring_teardown(self);
    nkv_uring_release(self);
    Py_RETURN_NONE;
}

static PyObject *
nkv_uring_fileno(nkv_uring *self, PyObject *unused)
{
    int fd;

    (void)unused;
    if (nkv_uring_acquire(self, "fileno") < 0) {
        return NULL;
    }
    fd = self->fd;
    nkv_uring_release(self);
    return PyLong_FromLong(fd);
}

static PyObject *
nkv_uring_get_in_flight(nkv_uring *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->fd < 0 ? 0 : self->in_flight);
}

static PyObject *
nkv_uring_get_entries(nkv_uring *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->entries);
}

/* ---------------------------------------------------------------- type, exec */

static PyObject *
nkv_uring_register_buffer(nkv_uring *self, PyObject *buffer)
{
    struct iovec pieces[NKV_FIXED_MAX_PIECES];
    Py_buffer view;
    unsigned count = 0;
    int rc = 0;
    int err = 0;

    if (nkv_uring_acquire(self, "register_buffer") < 0) {
        return NULL;
    }
    if (self->fixed.obj != NULL) {
        nkv_uring_release(self);
        return PyErr_Format(PyExc_ValueError,
                            "Uring.register_buffer: found a buffer already "
                            "registered, expected none");
    }
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0) {
        nkv_uring_release(self);
        return NULL;
    }
    size_t total = (size_t)view.len;
    if (total == 0 || total > NKV_FIXED_PIECE_BYTES * NKV_FIXED_MAX_PIECES) {
        PyBuffer_Release(&view);
        nkv_uring_release(self);
        return PyErr_Format(PyExc_ValueError,
                            "Uring.register_buffer: found %zd bytes, expected 1 to "
                            "%lu",
                            view.len, NKV_FIXED_PIECE_BYTES * NKV_FIXED_MAX_PIECES);
    }
    for (size_t done = 0; done < total; done += NKV_FIXED_PIECE_BYTES) {
        size_t left = total - done;
        pieces[count].iov_base = (char *)view.buf + done;
        pieces[count].iov_len = left < NKV_FIXED_PIECE_BYTES ? left
                                                             : NKV_FIXED_PIECE_BYTES;
        count++;
    }
    NKV_UNLOCKED(rc = (int)syscall(__NR_io_uring_register, self->fd,
                                   IORING_REGISTER_BUFFERS, pieces, count);
                 if (rc < 0) err = errno);
    if (rc < 0) {
        PyBuffer_Release(&view);
        nkv_uring_release(self);
        return nkv_err_set("io_uring_register(IORING_REGISTER_BUFFERS)", err);
    }
    self->fixed = view;
    nkv_uring_release(self);
    Py_RETURN_NONE;
}

static PyMethodDef nkv_uring_methods[] = {
    {"register_buffer", (PyCFunction)nkv_uring_register_buffer, METH_O,
     "register_buffer($self, buffer, /)\n--\n\n"
     "Pin a writable buffer in the kernel once (io_uring fixed buffers); requests\n"
     "wholly inside one 1 GiB piece of it use READ_FIXED/WRITE_FIXED. The buffer\n"
     "stays exported until close(). OSError where the kernel refuses (memlock)."},
    {"submit", (PyCFunction)nkv_uring_submit, METH_O,
     "submit($self, requests, /)\n--\n\n"
     "Queue (op, fd, offset, buffer, tag) requests, op 0 = read, 1 = write; one\n"
     "io_uring_enter, GIL released. Buffers stay pinned until reaped. ValueError\n"
     "if more than `entries` would be in flight."},
    {"reap", (PyCFunction)nkv_uring_reap, METH_VARARGS,
     "reap($self, min_complete=1, /)\n--\n\n"
     "Wait (GIL released) for at least min_complete completions (capped at\n"
     "in_flight); return all available. result: bytes moved or -errno."},
    {"close", (PyCFunction)nkv_uring_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "Wait for everything in flight, unpin its buffers, unmap the rings and\n"
     "close the ring fd. Idempotent."},
    {"fileno", (PyCFunction)nkv_uring_fileno, METH_NOARGS,
     "fileno($self, /)\n--\n\nThe ring fd."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
nkv_uring_get_fixed_submitted(nkv_uring *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->fixed_submitted);
}

static PyGetSetDef nkv_uring_getset[] = {
    {"fixed_submitted", (getter)nkv_uring_get_fixed_submitted, NULL,
     "requests sent through the registered buffer so far", NULL},
    {"in_flight", (getter)nkv_uring_get_in_flight, NULL,
     "requests submitted and not yet reaped (0 once closed)", NULL},
    {"entries", (getter)nkv_uring_get_entries, NULL,
     "most requests allowed in flight", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot nkv_uring_slots[] = {
    {Py_tp_doc, "Uring(entries, punt_reads=False)\n--\n\n"
                "An io_uring ring for file reads and writes (native/uring.c)."},
    {Py_tp_new, (void *)nkv_uring_new},
    {Py_tp_dealloc, (void *)nkv_uring_dealloc},
    {Py_tp_methods, nkv_uring_methods},
    {Py_tp_getset, nkv_uring_getset},
    {0, NULL},
};

static PyType_Spec nkv_uring_spec = {
    .name = "npukv_store._native.Uring",
    .basicsize = sizeof(nkv_uring),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, /* Python >= 3.10 */
    .slots = nkv_uring_slots,
};

int
nkv_uring_exec(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &nkv_uring_spec, NULL);
    int rc;

    if (type == NULL) {
        return -1;
    }
    rc = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return rc;
}
