/* The zygote's fork loop in C (optional: zygote.py has the same loop in Python, child.py the
 * same child set-up, zygote_wire.py the same wire format).
 *
 * Why C: every page a process writes after a fork is a copy-on-write fault while the child lives.
 * The Python loop writes about 175 pages between two forks (reference counts, frames, the
 * allocator's pools, the environment mapping); this loop writes a handful. It also sets the
 * child's sandbox up (session, descriptors, cores, uid, rlimits, environment) before the child
 * runs a line of Python, which spares the child the faults of doing that in Python.
 *
 * serve(sock, pid_namespace, own_pidns, devnull[, namespace, environ_data[, seccomp]]) runs
 * the loop (seccomp: the actions' filter as sock_filter bytes, or None). In the zygote it returns None once
 * the manager closes its end. In each forked child it returns (kind, code, argv, env_delta,
 * ctrl_fd, main_file, compiled) with the sandbox set up: code is a str or None, argv a tuple of
 * str or None, env_delta a tuple of (name, value or None) to bring os.environ (the zygote's) to
 * the action's; main_file the path the code was written to (None: it runs as `python -c`) and
 * compiled a read-only buffer of its code object, marshalled (None: compile it here).
 *
 * Wire format (little-endian), manager -> zygote, one datagram per action:
 *   "TZR1" i64 id, i32 uid (-1: keep), u32 flags (1: interpreter, 2: private /tmp and /dev/shm,
 *   4: a network namespace to enter comes as the last descriptor, 8: a mount namespace to enter
 *   (with its private /tmp and /dev/shm) comes before it, 16: the code is written to a main file
 *   and two more spans follow, 32: a /proc of its own PID namespace, 64: an IPC namespace of its
 *   own, 128: its writes confined with Landlock),
 *   u32 ncores, i32 cores[],
 *   u32 nlimits, {i32 resource, i64 value}[], then five spans of u32 len + bytes: workdir (NUL
 *   included), env ("K=V\0"...: the whole environment), env delta ("K=V\0" sets, "K\0" unsets),
 *   code (UTF-8, surrogates passed), argv ("arg\0"...; empty: none); with flag 16 also the main
 *   file's path (NUL included) and the code compiled by the manager (marshal; empty: none).
 *   Descriptors: run [stdout, stderr, (stdin)], interpreter [ctrl]. A request too large for one
 *   datagram is sent as "TZRM" i64 id u64 size with a memfd holding the whole request as the
 *   last descriptor.
 * zygote -> manager: "S" i64 id i32 pid + the child's pidfd; "E" i64 id + message;
 *   "X" i32 pid i32 status (-1: unknown) f64 cpu_s i64 max_rss_kb.
 *
 * In a PID namespace the action must not be the namespace's init: the kernel ignores the signals an
 * init sends itself (kill(getpid(), SIGKILL) would carry on, and abort() would end as SIGSEGV). So
 * the namespace's first process is a minimal init and the action its second, both children of this
 * loop, which reaps the action itself: its status is the true one, read by no process the action
 * can reach. The init is cheap: a clone sharing this process's memory (no page tables copied) that
 * runs a few raw system calls on a stack of its own, drops every descriptor, has its orphans reaped
 * by the kernel (SIGCHLD ignored) and sleeps. When the action has exited the init is killed, which
 * kills what is left in the namespace; the action's exit record is sent once the init is reaped,
 * that is, once nothing of the action is left (the kernel reaps a namespace before its init).
 * The action's own memory is a fork of this loop's, as before: it can neither see nor touch the
 * init's. (On other architectures than x86-64 and arm64 the action stays the init, as before.)
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <marshal.h>

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/filter.h>
#include <linux/seccomp.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define SETUP_FAILED 249
#define MAX_FDS 6 /* zygote_wire.REQUEST_MAX_FDS: out, err, in, two namespaces, a memfd */
#define MAX_PIDFD 65536
#define DGRAM_MAX (64 * 1024)

extern char **environ;

static unsigned char dgram[DGRAM_MAX];

typedef struct {
    const unsigned char *p, *end;
    int bad;
} reader;

static void take(reader *r, void *out, size_t n) {
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        memset(out, 0, n);
        return;
    }
    memcpy(out, r->p, n);
    r->p += n;
}

static const unsigned char *take_span(reader *r, uint32_t *len) {
    take(r, len, 4);
    if (r->bad || (size_t)(r->end - r->p) < *len) {
        r->bad = 1;
        *len = 0;
        return NULL;
    }
    const unsigned char *at = r->p;
    r->p += *len;
    return at;
}

/* The exception being raised, normalised, with its traceback; the error indicator cleared. */
static PyObject *raised_exception(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static void send_record(int sock, const void *data, size_t len, int fd) {
    struct iovec iov = {(void *)data, len};
    struct msghdr msg = {0};
    char control[CMSG_SPACE(sizeof(int))];
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
        memset(control, 0, sizeof control);
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

static void send_error(int sock, int64_t id, const char *what, int err) {
    char buf[512];
    buf[0] = 'E';
    memcpy(buf + 1, &id, 8);
    int n = snprintf(buf + 9, sizeof buf - 9, "%s: %s", what, strerror(err));
    if (n < 0) n = 0;
    if (n > (int)sizeof buf - 10) n = (int)sizeof buf - 10;
    send_record(sock, buf, 9 + (size_t)n, -1);
}

static void child_fail(const char *what) {
    char buf[256];
    int n = snprintf(buf, sizeof buf, "tangram: sandbox set-up failed: %s: %s\n", what, strerror(errno));
    if (n > 0) {
        ssize_t ignored = write(2, buf, (size_t)n);
        (void)ignored;
    }
    _exit(SETUP_FAILED);
}

#if defined(__x86_64__) || defined(__aarch64__)
#define CHEAP_INIT 1
/* System calls that touch no libc state: the init shares this process's memory, thread-local
 * errno included, and must leave every byte of it alone. */
static inline long raw_syscall(long n, long a1, long a2, long a3, long a4) {
#if defined(__x86_64__)
    long ret;
    register long r10 __asm__("r10") = a4;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a1), "S"(a2), "d"(a3), "r"(r10) : "rcx", "r11", "memory");
    return ret;
#else
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a1;
    register long x1 __asm__("x1") = a2;
    register long x2 __asm__("x2") = a3;
    register long x3 __asm__("x3") = a4;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3) : "memory");
    return x0;
#endif
}

#define INIT_STACK (32 * 1024)
#define MAX_FREE_STACKS 64

/* The namespace's init (see the header): never returns. */
static int ns_init(void *unused) {
    raw_syscall(SYS_close_range, 0, ~0u, 0, 0);
    raw_syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0);
    /* A kernel sigaction: handler, flags, restorer, mask. SIG_IGN: exited children are reaped. */
    unsigned long act[4] = {(unsigned long)SIG_IGN, 0, 0, 0};
    raw_syscall(SYS_rt_sigaction, SIGCHLD, (long)act, 0, 8);
    for (;;) raw_syscall(SYS_ppoll, 0, 0, 0, 0);
    return 0;
}

static void *free_stacks[MAX_FREE_STACKS];
static int nfree_stacks;

static void *take_stack(void) {
    if (nfree_stacks > 0) return free_stacks[--nfree_stacks];
    void *st = mmap(NULL, INIT_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    return st == MAP_FAILED ? NULL : st;
}

static void give_stack(void *st) {
    if (nfree_stacks < MAX_FREE_STACKS) free_stacks[nfree_stacks++] = st;
    else munmap(st, INIT_STACK);
}
#endif

static void give_stack_if(void *st) {
#ifdef CHEAP_INIT
    if (st != NULL) give_stack(st);
#else
    (void)st;
#endif
}

/* Per tracked pidfd: the action (with its init, while one runs) or an init. */
typedef struct {
    pid_t pid;
    int init_pidfd;   /* an action's: its init's pidfd, or -1 */
    int action_pidfd; /* an init's: its action's pidfd */
    int is_init;
    int exited;       /* an action that has exited and waits for its init's end */
    int32_t status;
    double cpu_s;
    int64_t max_rss_kb;
    void *stack;
    unsigned char *flag; /* an action's set-up flag (see setup_flag) */
    int setup_failed;
} kid;

/* Whether a child's set-up failed is told out of band, not by its exit status: a program may exit
 * with any status, SETUP_FAILED's included, and one taken for a set-up failure is retried and counted
 * against the host (an ordinary `exit 249` drained hosts). Each child has a byte of its own in a
 * region the zygote maps once, shared with its children, holding 1 while its set-up runs; the child
 * clears it just before the program starts (before execve, whose failure of the sandbox's own sets
 * it again, or before Python code runs) and unmaps the whole region then (an execve drops it), so
 * that no program reaches any byte of it. The zygote reads it at the child's exit. One region
 * rather than a page per child: three system calls less in the zygote per action, and a page per
 * child was inherited by every child forked while it lived (MADV_DONTFORK had to keep it from them).
 * In a child: its byte, until the program starts. */
#define FLAG_SLOTS MAX_PIDFD /* a child in flight holds a pidfd too */
static unsigned char *flag_slots = NULL;
static uint16_t free_flags[FLAG_SLOTS]; /* FLAG_SLOTS is at most 65536 */
static uint32_t nfree_flags;
static unsigned char *setup_flag = NULL;

static unsigned char *new_setup_flag(void) {
    if (flag_slots == NULL) {
        void *m = mmap(NULL, FLAG_SLOTS, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        flag_slots = m;
        for (uint32_t i = 0; i < FLAG_SLOTS; i++) free_flags[i] = (uint16_t)(FLAG_SLOTS - 1 - i);
        nfree_flags = FLAG_SLOTS;
    }
    if (nfree_flags == 0) {
        errno = EMFILE;
        return NULL;
    }
    unsigned char *flag = flag_slots + free_flags[--nfree_flags];
    *(volatile unsigned char *)flag = 1;
    return flag;
}

static void free_setup_flag(unsigned char *flag) {
    *(volatile unsigned char *)flag = 0;
    free_flags[nfree_flags++] = (uint16_t)(flag - flag_slots);
}

/* In a child: its set-up is over (``running`` 0) or, after a failed execve of the sandbox's own
 * making, failed after all (1); ``unmap``: the program starts in this process, so the region goes. */
static void mark_setup(int running, int unmap) {
    if (setup_flag == NULL) return;
    *(volatile unsigned char *)setup_flag = (unsigned char)(running != 0);
    if (unmap) {
        munmap(flag_slots, FLAG_SLOTS);
        flag_slots = NULL;
        setup_flag = NULL;
    }
}

static kid kids[MAX_PIDFD];

/* A private, writable /tmp and /dev/shm for this action: fresh tmpfs mounts in a mount namespace of
 * its own (gone with its last process), each at most its memory limit. Where the workdir root lies
 * under one of them (by default it is on /dev/shm), it is bound back at its own path. */
#define IDENTITY_MAX 4
#define IDENTITY_NAME_MAX 64
static char identity[IDENTITY_MAX][2][IDENTITY_NAME_MAX];
static int n_identity = 0;
/* Files (and directories) each of them may hold: one per tmp_bytes_per_file of its size, at least
 * tmp_min_files (set_tmp_files; child.tmp_options is the Python loop's twin and says why). */
static long long tmp_bytes_per_file = 0;
static long long tmp_min_files = 0;

/* The mount options of one of them of `size` bytes (0: no bound). */
static void tmp_options(char *out, size_t n, long long size) {
    if (size > 0 && tmp_bytes_per_file > 0) {
        long long files = size / tmp_bytes_per_file;
        if (files < tmp_min_files) files = tmp_min_files;
        if (files < 1) files = 1; /* 0 would be no bound */
        snprintf(out, n, "size=%lld,nr_inodes=%lld,mode=1777", size, files);
    } else if (size > 0) {
        snprintf(out, n, "size=%lld,mode=1777", size);
    } else {
        snprintf(out, n, "mode=1777");
    }
}

/* The request's limit on `which` (0: none). */
static long long limit_of(const unsigned char *limits, uint32_t nlimits, int which) {
    long long size = 0;
    for (uint32_t i = 0; i < nlimits; i++) {
        int32_t res;
        int64_t value;
        memcpy(&res, limits + i * 12, 4);
        memcpy(&value, limits + i * 12 + 4, 8);
        if (res == which) size = value;
    }
    return size;
}

/* child.ipc_bounds's twin: what the action's own IPC namespace may hold, from its memory limit
 * (child.py says why each bound is what it is: IPC_QUEUE_BYTES, IPC_SEM_BYTES, SEM_DEFAULTS). */
static void ipc_bounds(long long size, long long *shm_pages, long long *queues, long long *sems) {
    *shm_pages = size / sysconf(_SC_PAGESIZE);
    *queues = size / (2LL << 20);
    if (*queues < 16) *queues = 16;
    if (*queues > 32000) *queues = 32000; /* the kernel's default */
    *sems = size / 128;
    if (*sems < 32000) *sems = 32000;
    if (*sems > 1024000000) *sems = 1024000000; /* the kernel's default */
}

/* Write `text` to `path`, best effort (a /proc file the kernel may refuse). */
static void put(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, text, strlen(text)) < 0) { /* best effort */
    }
    close(fd);
}

/* What the program may write (child.py's `written`): its data limit beyond Python, its address
 * space in it. */
/* What the action may write (zygote_wire.WRITTEN, -1, says what): no rlimit of its own. */
#define LIMIT_WRITTEN (-1)

static long long written_limit(const unsigned char *limits, uint32_t nlimits) {
    long long size = limit_of(limits, nlimits, LIMIT_WRITTEN);
    if (size <= 0) size = limit_of(limits, nlimits, RLIMIT_DATA);
    return size > 0 ? size : limit_of(limits, nlimits, RLIMIT_AS);
}

/* The action's own IPC namespace holds System V memory up to its memory limit `size` (child.bound_ipc
 * says why). Where /proc/sys cannot be written, the kernel's defaults stay. */
static void bound_ipc(long long size) {
    if (size <= 0) return;
    long long shm_pages, queues, sems;
    ipc_bounds(size, &shm_pages, &queues, &sems);
    char text[64];
    snprintf(text, sizeof text, "%lld", shm_pages);
    put("/proc/sys/kernel/shmall", text);
    snprintf(text, sizeof text, "%lld", queues);
    put("/proc/sys/kernel/msgmni", text);
    snprintf(text, sizeof text, "32000 %lld 500 32000", sems); /* child.SEM_DEFAULTS */
    put("/proc/sys/kernel/sem", text);
}

static void private_tmp(const char *workdir, long long size) {
    char root[4096];
    size_t wlen = strlen(workdir);
    if (wlen >= sizeof root) {
        errno = ENAMETOOLONG;
        child_fail("private /tmp");
    }
    memcpy(root, workdir, wlen + 1);
    char *slash = strrchr(root, '/');
    if (slash == NULL || slash == root) {
        errno = EINVAL;
        child_fail("private /tmp");
    }
    *slash = '\0';
    if (syscall(SYS_unshare, CLONE_NEWNS) < 0) child_fail("unshare(CLONE_NEWNS)");
    /* Taken in the new namespace (a bind source must belong to it), before the covering mounts. */
    int rootfd = open(root, O_PATH | O_CLOEXEC);
    if (rootfd < 0) child_fail("open(workdir root)");
    char opts[128];
    tmp_options(opts, sizeof opts, size);
    static const char *const points[] = {"/tmp", "/dev/shm"};
    for (size_t i = 0; i < 2; i++) {
        if (mount("tangram", points[i], "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) child_fail("mount tmpfs");
        size_t plen = strlen(points[i]);
        if (strncmp(root, points[i], plen) == 0 && root[plen] == '/') {
            /* Recreate the root's path inside the fresh tmpfs, then bind the real root there. */
            for (char *p = root + plen + 1; *p; p++) {
                if (*p != '/') continue;
                *p = '\0';
                mkdir(root, 0755);
                *p = '/';
            }
            if (mkdir(root, 0711) < 0 && errno != EEXIST) child_fail("mkdir(workdir root)");
            char src[64];
            snprintf(src, sizeof src, "/proc/self/fd/%d", rootfd);
            if (mount(src, root, NULL, MS_BIND | MS_REC, NULL) < 0) child_fail("bind(workdir root)");
        }
    }
    close(rootfd);
    /* The action's passwd and group over the host's (zygote_wire.IDENTITY_FILES says why; set at
     * start by set_identity): files the agent wrote into the workdir root when it may switch uids.
     * A bind that fails leaves the host's file (a name is not worth failing an action for). */
    for (int i = 0; i < n_identity; i++) {
        char src[4096 + IDENTITY_NAME_MAX + 2];
        snprintf(src, sizeof src, "%s/%s", root, identity[i][0]);
        if (access(src, F_OK) == 0 && access(identity[i][1], F_OK) == 0)
            (void)mount(src, identity[i][1], NULL, MS_BIND, NULL);
    }
}

/* A /proc of the action's own PID namespace (it is the namespace's second process, in a mount
 * namespace of its own): it sees its own processes only, under the PIDs they have there, and none
 * of another action's command lines. Mounted over what /proc showed before (the host's, or the last
 * action's in a reused mount namespace), which no path reaches any more, rather than unmounting
 * that first: an unmount waits for an RCU grace period, and the action's core sat idle meanwhile
 * (0.4 ms median per action at c=16 on 2 cores, a third of a core in all, measured). The fork
 * server retires a pooled mount namespace after forkserver.MNTNS_USES actions, and the pile goes
 * with it, in one grace period. */
static void own_proc(void) {
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) child_fail("mount /proc");
}

/* The actions' seccomp filter (serve's last argument; none when it is None). */
static struct sock_fprog seccomp_prog = {0, NULL};

/* Landlock: isolation.restrict_writes's twin (its comment says what and why). The system call
 * numbers are the same on every architecture (new calls share one table since Linux 5.1). */
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#define LL_WRITE_FILE (1ull << 1)
#define LL_CHANGES (LL_WRITE_FILE | (((1ull << 13) - 1) & ~((1ull << 4) - 1))) /* remove, make */
#define LL_REFER (1ull << 13)
#define LL_TRUNCATE (1ull << 14)

struct ll_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

static void ll_allow(int ruleset, const char *path, uint64_t access) {
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return;
        child_fail("landlock: open");
    }
    struct ll_path_beneath rule = {access, fd};
    if (syscall(SYS_landlock_add_rule, ruleset, 1 /* LANDLOCK_RULE_PATH_BENEATH */, &rule, 0) < 0)
        child_fail("landlock_add_rule");
    close(fd);
}

static void restrict_writes(const char *workdir) {
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, 1u /* LANDLOCK_CREATE_RULESET_VERSION */);
    uint64_t handled = LL_CHANGES | LL_REFER | (abi >= 3 ? LL_TRUNCATE : 0);
    uint64_t attr = handled;
    int ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0u);
    if (ruleset < 0) child_fail("landlock_create_ruleset");
    static const char *const trees[] = {"/tmp", "/dev/shm"};
    static const char *const written[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
                                          "/dev/tty",  "/dev/ptmx", "/dev/pts",  "/proc"};
    ll_allow(ruleset, workdir, handled);
    for (size_t i = 0; i < sizeof trees / sizeof *trees; i++) ll_allow(ruleset, trees[i], handled);
    for (size_t i = 0; i < sizeof written / sizeof *written; i++)
        ll_allow(ruleset, written[i], handled & (LL_WRITE_FILE | LL_TRUNCATE));
    if (syscall(SYS_landlock_restrict_self, ruleset, 0u) < 0) child_fail("landlock_restrict_self");
    close(ruleset);
}

/* In the child: everything _child_main does in Python, up to running the action. */
static void child_setup(int interp, int *fds, int nfds, int devnull, int32_t uid, const int32_t *cores,
                        uint32_t ncores, const unsigned char *limits, uint32_t nlimits,
                        const char *workdir, const char *env, uint32_t env_len, int private_mounts,
                        int proc_of_its_own, int ipc_of_its_own, int restrict_fs, int under_init) {
    /* Under its namespace's init, the program leads a process group of its own in the fork
     * server's session (which has no terminal): its setpgrp() works as outside (a session's leader
     * may not, EPERM), what it signals as its group (kill(0), `kill -- -$$`, killpg(getpgrp()))
     * is its own, never the zygote's. Not a group's leader it cannot be here: a group led by
     * another process of its namespace would be its init's, PID 1, and killpg(1) is kill(-1).
     * So setsid() still fails, EPERM, as for a group's leader outside. Without an init it leads a
     * session of its own. */
    if (under_init) {
        if (setpgid(0, 0) < 0) child_fail("setpgid");
    } else if (setsid() < 0) {
        child_fail("setsid");
    }
    int in_fd = devnull, out_fd = devnull, err_fd = devnull, ctrl = -1;
    if (interp) {
        ctrl = fds[0];
    } else {
        out_fd = fds[0];
        err_fd = fds[1];
        if (nfds > 2) in_fd = fds[2];
    }
    if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) child_fail("dup2");
    if (ctrl >= 0) {
        if (ctrl != 3 && dup2(ctrl, 3) < 0) child_fail("dup2");
        if (ctrl == 3) fcntl(3, F_SETFD, 0);
        syscall(SYS_close_range, 4u, ~0u, 0);
    } else {
        syscall(SYS_close_range, 3u, ~0u, 0);
    }
    if (ncores) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (uint32_t i = 0; i < ncores; i++) {
            if (cores[i] < 0 || cores[i] >= CPU_SETSIZE) {
                errno = EINVAL;
                child_fail("sched_setaffinity");
            }
            CPU_SET(cores[i], &set);
        }
        if (sched_setaffinity(0, sizeof set, &set) < 0) child_fail("sched_setaffinity");
    }
    long long written = written_limit(limits, nlimits);
    if (private_mounts) private_tmp(workdir, written);
    if (proc_of_its_own) own_proc();
    /* Its own System V and POSIX IPC objects (forkserver's probe says why). */
    if (ipc_of_its_own) {
        if (syscall(SYS_unshare, CLONE_NEWIPC) < 0) child_fail("unshare(CLONE_NEWIPC)");
        bound_ipc(written);
    }
    if (chdir(workdir) < 0) child_fail("chdir");
    umask(022);
    /* The OOM killer's first choice, before the agent (child.oom_first says why). */
    put("/proc/self/oom_score_adj", "1000");
    if (uid >= 0) {
        if (setgroups(0, NULL) < 0) child_fail("setgroups");
        if (setgid((gid_t)uid) < 0) child_fail("setgid");
        if (setuid((uid_t)uid) < 0) child_fail("setuid");
        /* Dumpable again, as after the execve that starts a program outside: the uid change cleared
         * it, and a Python action (which never execs) had its /proc/self/environ, auxv, io, ns, ...
         * root's, refused (EACCES) where they are the program's. Nothing of another uid is reachable
         * through it (its init is root's). A session's interpreter stays undumpable (its key). */
        if (!interp && prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0) child_fail("prctl(PR_SET_DUMPABLE)");
    }
    /* After the uid change, which would clear it: the namespace's init must not outlive us. */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    for (uint32_t i = 0; i < nlimits; i++) {
        int32_t res;
        int64_t value;
        memcpy(&res, limits + i * 12, 4);
        memcpy(&value, limits + i * 12 + 4, 8);
        if (value <= 0 || res == LIMIT_WRITTEN) continue;
        struct rlimit rl = {(rlim_t)value, (rlim_t)value};
        if (res == RLIMIT_CPU) rl.rlim_max = (rlim_t)value + 1; /* SIGXCPU first, then SIGKILL */
        if (res == RLIMIT_AS || res == RLIMIT_DATA || res == RLIMIT_STACK) {
            /* zygote_wire.SOFT_ONLY: the hard limit stays the agent's (SandboxFusion sets the soft
             * one), so that a harness may raise the soft one as it may outside. */
            struct rlimit now;
            if (getrlimit(res, &now) < 0) child_fail("getrlimit");
            rl.rlim_max = now.rlim_max;
            if (rl.rlim_cur > now.rlim_max) rl.rlim_cur = now.rlim_max; /* RLIM_INFINITY: the most */
        }
        if (setrlimit(res, &rl) < 0) child_fail("setrlimit");
    }
    struct rlimit nocore = {0, 0};
    setrlimit(RLIMIT_CORE, &nocore);
    if (restrict_fs) restrict_writes(workdir); /* after the mounts, which it would refuse */
    /* Last of the set-up, which needs calls it refuses (mounts): the actions' seccomp filter
     * (seccomp.py; no_new_privs, which it needs, the fork server set for all its children). */
    if (seccomp_prog.filter != NULL && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &seccomp_prog, 0, 0) < 0)
        child_fail("prctl(PR_SET_SECCOMP)");
    /* The action's environment: pointers into the request (this copy of it is the child's). */
    size_t count = 0;
    for (uint32_t i = 0; i < env_len; i++)
        if (env[i] == '\0') count++;
    char **envp = malloc((count + 1) * sizeof(char *));
    if (envp == NULL) child_fail("malloc");
    size_t k = 0;
    for (uint32_t i = 0; i < env_len;) {
        envp[k++] = (char *)env + i;
        i += (uint32_t)strlen(env + i) + 1;
    }
    envp[k] = NULL;
    environ = envp;
}

/* NUL-separated strings as a tuple of str (NULL on error). */
static PyObject *strings(const unsigned char *at, uint32_t len) {
    Py_ssize_t count = 0;
    for (uint32_t i = 0; i < len; i++)
        if (at[i] == '\0') count++;
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    uint32_t i = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        size_t n = strlen((const char *)at + i);
        PyObject *s = PyUnicode_DecodeFSDefaultAndSize((const char *)at + i, (Py_ssize_t)n);
        if (s == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, k, s);
        i += (uint32_t)n + 1;
    }
    return out;
}

/* The action's code as its main file, written as the action's uid (after the set-up, so within its
 * limits): what `python main.py` would run, for tracebacks, __file__ and inspect. Here in C rather
 * than in the child's Python, where the same few system calls cost a dozen copy-on-write faults.
 * 0 when it could not be written (a full disk, a file limit): the code then runs as `python -c`. */
static int write_main(const char *path, const unsigned char *code, uint32_t clen) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return 0;
    uint32_t done = 0;
    while (done < clen) {
        ssize_t n = write(fd, code + done, clen - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            close(fd);
            unlink(path);
            return 0;
        }
        done += (uint32_t)n;
    }
    close(fd);
    return 1;
}

/* What the straight path below needs, given to serve() by the zygote (NULL: not given). */
static PyObject *run_namespace;  /* the prepared __main__'s names every child starts from (child.py) */
static PyObject *run_main;       /* a __main__ made of them once serve() starts (fresh_main) */
static PyObject *environ_data;   /* os.environ._data, the mapping os.environ reads */

static void put_environ(const unsigned char *delta, uint32_t dlen) {
    for (uint32_t i = 0; i < dlen;) {
        const char *item = (const char *)delta + i;
        size_t n = strlen(item);
        const char *eq = memchr(item, '=', n);
        PyObject *key = PyBytes_FromStringAndSize(item, eq ? eq - item : (Py_ssize_t)n);
        if (key == NULL) child_fail("the environment");
        if (eq) {
            PyObject *value = PyBytes_FromStringAndSize(eq + 1, (Py_ssize_t)(n - (size_t)(eq - item) - 1));
            if (value == NULL || PyDict_SetItem(environ_data, key, value) < 0) child_fail("the environment");
            Py_DECREF(value);
        } else if (PyDict_DelItem(environ_data, key) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(key);
        i += (uint32_t)n + 1;
    }
}

/* Names the straight path looks up, made once in the zygote (interned: the very objects the
 * dictionaries hold as keys), and the sys module's dict. A look-up by C string makes and drops a
 * str in every child, and each such allocation writes pages of the child's copy of the heap. */
enum {
    K_ARGV, K_PATH, K_MODULES, K_FILE, K_NUMPY, K_RANDOM, K_SEED,
    /* The run's end (end_run) */
    K_STDOUT, K_STDERR, K_FIRST_STDOUT, K_FIRST_STDERR, K_FLUSH, K_CLOSED, K_CODE, K_EXCEPTHOOK,
    K_LAST_TYPE, K_LAST_VALUE, K_LAST_TRACEBACK, K_LAST_EXC, K_THREADING, K_SHUTDOWN, K_BUILTINS,
    K_UNRAISABLEHOOK, K_LOADER, K_MAIN, K_STDIN, K_FIRST_STDIN, K_CACHED, K_NAME,
    K_DOC, K_PACKAGE, K_SPEC, K_ANNOTATIONS, K_PS1, K_PS2, K_PATH_HOOKS, K_PATH_IMPORTER_CACHE,
    K_META_PATH, K_INTERACTIVEHOOK, K_UNDERSCORE,
    /* A session's calls (serve_session) */
    K_STRING, K_EXEC, K_DONT_INHERIT, N_NAMES
};
static const char *const name_text[N_NAMES] = {
    "argv", "path", "modules", "__file__", "numpy", "random", "seed",
    "stdout", "stderr", "__stdout__", "__stderr__", "flush", "closed", "code", "excepthook",
    "last_type", "last_value", "last_traceback", "last_exc", "threading", "_shutdown", "__builtins__",
    "unraisablehook", "__loader__", "__main__", "stdin", "__stdin__", "__cached__", "__name__",
    "__doc__", "__package__", "__spec__", "__annotations__", "ps1", "ps2", "path_hooks", "path_importer_cache",
    "meta_path", "__interactivehook__", "_",
    "<string>", "exec", "dont_inherit",
};
static PyObject *names[N_NAMES];
static PyObject *sys_dict;
/* What the run's end calls that a program could otherwise replace by name, where Python's own end
 * calls C (_PyAtExit_Call): taken here, before any program runs. */
static PyObject *run_exitfuncs; /* atexit._run_exitfuncs */
static PyObject *unraisable_args; /* sys.UnraisableHookArgs, which sys does not name (NULL: unknown) */
static PyObject *source_loader;   /* SourceFileLoader: what loads a script's __main__ (NULL: unknown) */
static PyObject *compile_source;  /* builtins.compile, as the interpreter had it (a session's calls) */
static PyObject *set_signal;      /* _signal.signal (signals_off) */
static PyObject *get_signal;      /* _signal.getsignal (signals_off) */
static PyObject *gc_callbacks;    /* the list gc calls back, which _PyGC_CollectNoFail does not */

static PyObject *attribute_of(const char *module, const char *name) {
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) return NULL;
    PyObject *value = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return value;
}

/* The type of what the interpreter hands sys.unraisablehook, taken from one error it reports to a
 * hook that keeps it. */
static PyObject *unraisable_args_type(void) {
    PyObject *seen = PyList_New(0);
    PyObject *keep = seen != NULL ? PyObject_GetAttrString(seen, "append") : NULL;
    PyObject *hook = PyDict_GetItemWithError(sys_dict, names[K_UNRAISABLEHOOK]);
    PyObject *type = NULL;
    if (keep != NULL && hook != NULL) {
        Py_INCREF(hook);
        if (PyDict_SetItem(sys_dict, names[K_UNRAISABLEHOOK], keep) == 0) {
            PyErr_SetString(PyExc_RuntimeError, "the type of an unraisable error's report");
            PyErr_WriteUnraisable(Py_None);
            if (PyList_GET_SIZE(seen) == 1) type = Py_NewRef((PyObject *)Py_TYPE(PyList_GET_ITEM(seen, 0)));
        }
        if (PyDict_SetItem(sys_dict, names[K_UNRAISABLEHOOK], hook) < 0) Py_CLEAR(type);
        Py_DECREF(hook);
    }
    PyErr_Clear();
    Py_XDECREF(keep);
    Py_XDECREF(seen);
    return type;
}

/* Once per process: in the zygote (serve), or in a child of the Python loop before its program runs
 * (run_to_end). */
static int prepare_names(void) {
    if (sys_dict != NULL) return 0;
    for (int i = 0; i < N_NAMES; i++)
        if ((names[i] = PyUnicode_InternFromString(name_text[i])) == NULL) return -1;
    if ((run_exitfuncs = attribute_of("atexit", "_run_exitfuncs")) == NULL) return -1;
    if ((compile_source = attribute_of("builtins", "compile")) == NULL) return -1;
    if ((set_signal = attribute_of("_signal", "signal")) == NULL) return -1;
    if ((get_signal = attribute_of("_signal", "getsignal")) == NULL) return -1;
    if ((gc_callbacks = attribute_of("gc", "callbacks")) == NULL) return -1;
    PyObject *sys = PyImport_ImportModule("sys");
    if (sys == NULL) return -1;
    sys_dict = Py_NewRef(PyModule_GetDict(sys));
    Py_DECREF(sys);
    unraisable_args = unraisable_args_type();
    if ((source_loader = attribute_of("_frozen_importlib_external", "SourceFileLoader")) == NULL) PyErr_Clear();
    return 0;
}

/* sys.<name>, borrowed (NULL when unset). */
static PyObject *sys_get(int name) { return PyDict_GetItem(sys_dict, names[name]); }

static void call_method(PyObject *obj, int name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, names[name]);
    Py_XDECREF(r);
    PyErr_Clear();
}

/* The thread's whole recursion budget, as a fresh interpreter has it where it starts a script. */
static void full_recursion_budget(void) {
#if PY_VERSION_HEX >= 0x030C0000
    PyThreadState_Get()->py_recursion_remaining = PyThreadState_Get()->py_recursion_limit;
#elif PY_VERSION_HEX >= 0x030B0000
    PyThreadState_Get()->recursion_remaining = PyThreadState_Get()->recursion_limit;
#endif
}

/* The run's end, as `python main.py` ends (Py_RunMain, Py_FinalizeEx) and for both loops: the status
 * from the program's exception, then its threads, its exit functions, its streams, __main__ let go
 * of and collected, and _exit with the status. All of it here, with what it calls taken before the
 * program ran: a program can reach every Python function of the sandbox (sys.modules) and replace
 * its code or the names it calls. With the end in Python, one that wrapped os._exit to exit 0
 * wherever a module held it, or made every function outside the standard library exit 0, failed
 * outside and passed here. What Python's own end looks up by name (threading._shutdown, the
 * streams and their methods, sys.excepthook) is looked up by name here too: replacing those does
 * the same outside. child.py's _finish_and_exit is its twin where this module is not built. */

#define BY_SIGINT (-2) /* the status that stands for "ends by SIGINT" (child._BY_SIGINT) */

/* sys.<name> (borrowed, NULL when unset) while the program may have changed it. */
static PyObject *sys_now(int name) {
    PyObject *value = PyDict_GetItemWithError(sys_dict, names[name]);
    if (value == NULL) PyErr_Clear();
    return value;
}

/* The same, a strong reference (NULL or None: none): what the program's code may drop meanwhile. */
static PyObject *sys_held(int name) {
    PyObject *value = sys_now(name);
    return value != NULL && value != Py_None ? Py_NewRef(value) : NULL;
}

static void sys_set(int name, PyObject *value) {
    if (PyDict_SetItem(sys_dict, names[name], value) < 0) PyErr_Clear();
}

/* Python's file_is_closed: a `closed` that cannot be read or tested counts as open. */
static int is_closed(PyObject *stream) {
    PyObject *closed = PyObject_GetAttr(stream, names[K_CLOSED]);
    if (closed == NULL) {
        PyErr_Clear();
        return 0;
    }
    int r = PyObject_IsTrue(closed);
    Py_DECREF(closed);
    if (r < 0) PyErr_Clear();
    return r > 0;
}

/* stream.flush(); 0 when it raised (the error left set). */
static int flush_stream(PyObject *stream) {
    PyObject *r = PyObject_CallMethodNoArgs(stream, names[K_FLUSH]);
    Py_XDECREF(r);
    return r != NULL;
}

/* Python's flush_io, once the main module has run (or raised, before the error is printed):
 * stderr, then stdout, errors ignored. What the program printed comes before what its threads,
 * exit functions and subprocesses write at its end. */
static void flush_io(void) {
    const int order[2] = {K_STDERR, K_STDOUT};
    for (int i = 0; i < 2; i++) {
        PyObject *stream = sys_held(order[i]);
        if (stream != NULL && !flush_stream(stream)) PyErr_Clear();
        Py_XDECREF(stream);
    }
}

/* As PyErr_WriteUnraisable(obj) for the error being raised, with the exception's own traceback:
 * PyErr_WriteUnraisable adds the frame running, if any, as Python's end has none. */
static void write_unraisable(PyObject *obj) {
    PyObject *exc = raised_exception();
    PyObject *hook = sys_held(K_UNRAISABLEHOOK);
    if (exc == NULL || unraisable_args == NULL || hook == NULL) {
        if (exc != NULL) PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
        PyErr_WriteUnraisable(obj);
        Py_XDECREF(hook);
        return;
    }
    PyObject *tb = PyException_GetTraceback(exc);
    PyObject *fields = PyTuple_Pack(5, (PyObject *)Py_TYPE(exc), exc, tb != NULL ? tb : Py_None, Py_None, obj);
    PyObject *report = fields != NULL ? PyObject_CallOneArg(unraisable_args, fields) : NULL;
    PyObject *r = report != NULL ? PyObject_CallOneArg(hook, report) : NULL;
    Py_XDECREF(r);
    Py_XDECREF(report);
    Py_XDECREF(fields);
    Py_XDECREF(tb);
    Py_DECREF(exc);
    Py_DECREF(hook);
    PyErr_Clear();
}

/* Python's flush_std_files: 0 when one that is not closed failed (Python then exits 120). */
static int flush_std_files(void) {
    int ok = 1;
    PyObject *out = sys_held(K_STDOUT);
    if (out != NULL && !is_closed(out) && !flush_stream(out)) {
        ok = 0;
        write_unraisable(out);
    }
    Py_XDECREF(out);
    PyObject *err = sys_held(K_STDERR);
    if (err != NULL && !is_closed(err) && !flush_stream(err)) {
        ok = 0;
        PyErr_Clear();
    }
    Py_XDECREF(err);
    return ok;
}

/* Python's _Py_HandleSystemExit, given the value raised as the interpreter holds it (below 3.12,
 * `sys.exit(x)` leaves x itself, not a SystemExit): None 0; an exception's `code` (where it has
 * one; else the exception is printed); an int as (int)PyLong_AsLong gives it (beyond a C long: -1,
 * status 255), its low 8 bits the status; anything else printed to stderr, status 1. */
static int exit_code_of(PyObject *value) {
    fflush(stdout);
    if (value == NULL || value == Py_None) return 0;
    Py_INCREF(value);
    if (PyExceptionInstance_Check(value)) {
        PyObject *code = PyObject_GetAttr(value, names[K_CODE]);
        if (code == NULL) {
            PyErr_Clear(); /* no `code` to dig out: the exception itself is printed, as Python does */
        } else {
            Py_SETREF(value, code);
            if (value == Py_None) {
                Py_DECREF(value);
                return 0;
            }
        }
    }
    int status = 1;
    if (PyLong_Check(value)) { /* the real type, and its value, whatever a subclass overrides */
        long v = PyLong_AsLong(value);
        if (v == -1 && PyErr_Occurred()) PyErr_Clear();
        status = (int)v & 0xFF;
    } else {
        PyObject *err = sys_held(K_STDERR);
        if (err != NULL) {
            if (PyFile_WriteObject(value, err, Py_PRINT_RAW) < 0) PyErr_Clear();
            Py_DECREF(err);
        } else {
            if (PyObject_Print(value, stderr, Py_PRINT_RAW) < 0) PyErr_Clear();
            fflush(stderr);
        }
        PySys_WriteStderr("\n");
        PyErr_Clear();
    }
    Py_DECREF(value);
    return status;
}

/* How a run ended, as the interpreter holds its error: the type (NULL: no error) and the value. The
 * type is what PyErr_Print decides on below 3.12, where `raise E` keeps E as the type even when
 * E() returned another exception (a class whose __new__ returns SystemExit(0) fails outside, with
 * its traceback printed). A SystemExit's value is left as raised (_Py_HandleSystemExit reads it
 * so); any other is normalised, with its traceback. */
typedef struct {
    PyObject *type;
    PyObject *value;
} ending;

static ending fetch_ending(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) { /* a failure with no exception set: never a success */
        Py_XDECREF(value);
        Py_XDECREF(tb);
        type = Py_NewRef(PyExc_SystemError);
        value = PyObject_CallFunction(PyExc_SystemError, "s", "the program failed with no exception set");
        PyErr_Clear();
        return (ending){type, value};
    }
    if (PyErr_GivenExceptionMatches(type, PyExc_SystemExit)) {
        Py_XDECREF(tb);
        return (ending){type, value};
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL && PyExceptionInstance_Check(value)) PyException_SetTraceback(value, tb);
    Py_XDECREF(tb);
    return (ending){type, value};
}

static void drop_ending(ending *e) {
    Py_CLEAR(e->type);
    Py_CLEAR(e->value);
}

/* As PyErr_Print after a program's uncaught exception: sys.last_* set (the exit functions may read
 * them), the "sys.excepthook" audit event, then sys.excepthook, or the interpreter's printer where
 * the program deleted it. A hook that raises SystemExit ends the program with its status (returned;
 * else -1, and `*by_exit` set); one that raises anything else is reported with the original
 * exception. Called from here, no frame of ours is on either traceback. */
static int report(ending e, int *by_exit) {
    PyObject *type = e.type, *value = e.value != NULL ? e.value : Py_None;
    PyObject *tb = PyExceptionInstance_Check(value) ? PyException_GetTraceback(value) : NULL;
    PyObject *tb_or_none = tb != NULL ? tb : Py_None;
    sys_set(K_LAST_TYPE, type);
    sys_set(K_LAST_VALUE, value);
    sys_set(K_LAST_TRACEBACK, tb_or_none);
#if PY_VERSION_HEX >= 0x030C0000
    sys_set(K_LAST_EXC, value);
#endif
    int status = -1;
    PyObject *hook = sys_held(K_EXCEPTHOOK);
    if (PySys_Audit("sys.excepthook", "OOOO", hook != NULL ? hook : Py_None, type, value, tb_or_none) < 0) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            PyErr_Clear(); /* an audit hook that refuses it: nothing is printed, as in Python */
            goto done;
        }
        PyErr_WriteUnraisable(NULL);
    }
    if (hook == NULL) {
        PySys_WriteStderr("sys.excepthook is missing\n");
        PyErr_Display(type, value, tb_or_none);
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(hook, type, value, tb_or_none, NULL);
        if (r == NULL) {
            ending failed = fetch_ending();
            if (PyErr_GivenExceptionMatches(failed.type, PyExc_SystemExit)) {
                *by_exit = 1;
                status = exit_code_of(failed.value);
            } else {
                PyObject *failed_value = failed.value != NULL ? failed.value : Py_None;
                PyObject *failed_tb =
                    PyExceptionInstance_Check(failed_value) ? PyException_GetTraceback(failed_value) : NULL;
                fflush(stdout);
                PySys_WriteStderr("Error in sys.excepthook:\n");
                PyErr_Display(failed.type, failed_value, failed_tb != NULL ? failed_tb : Py_None);
                Py_XDECREF(failed_tb);
                PySys_WriteStderr("\nOriginal exception was:\n");
                PyErr_Display(type, value, tb_or_none);
            }
            drop_ending(&failed);
        }
        Py_XDECREF(r);
    }
done:
    Py_XDECREF(hook);
    Py_XDECREF(tb);
    PyErr_Clear();
    return status;
}

/* The status of a program that ended with `e`: a SystemExit's code (`*by_exit` set); otherwise the
 * exception reported, then the end by SIGINT after a KeyboardInterrupt of exactly that class
 * (run_eval_code_obj compares the class itself, so a subclass ends with 1), else 1. */
static int status_of(ending e, int *by_exit) {
    if (PyErr_GivenExceptionMatches(e.type, PyExc_SystemExit)) {
        *by_exit = 1;
        return exit_code_of(e.value);
    }
    int hooked = report(e, by_exit);
    if (hooked >= 0) return hooked;
    return e.type == PyExc_KeyboardInterrupt ? BY_SIGINT : 1;
}

/* Python's finalize_modules_delete_special, before the modules go: these sys names None (the last
 * exception among them, which lets its frames go), and the standard streams back to the ones the
 * program started with (a finaliser's print goes there, as it does in Python). */
static void delete_special(void) {
    const int deletes[] = {K_PATH, K_ARGV, K_PS1, K_PS2, K_LAST_TYPE, K_LAST_VALUE, K_LAST_TRACEBACK,
#if PY_VERSION_HEX >= 0x030C0000
                           K_LAST_EXC,
#endif
                           K_PATH_HOOKS, K_PATH_IMPORTER_CACHE, K_META_PATH, K_INTERACTIVEHOOK};
    /* The import system's finders and caches are kept (never freed: freeing the listings of every
     * directory on sys.path would write pages the zygote shares with every action), as Python's
     * own import state keeps them alive there. The rest are let go of: the last exception holds
     * the program's frames and so its globals, and sys.path may hold objects of the program's. */
    for (size_t i = 0; i < sizeof deletes / sizeof deletes[0]; i++) {
        int kept = deletes[i] == K_PATH_HOOKS || deletes[i] == K_PATH_IMPORTER_CACHE || deletes[i] == K_META_PATH;
        if (kept) Py_XINCREF(sys_now(deletes[i]));
        sys_set(deletes[i], Py_None);
    }
    PyObject *builtins = PyEval_GetBuiltins();
    if (builtins != NULL && PyDict_SetItem(builtins, names[K_UNDERSCORE], Py_None) < 0) PyErr_Clear();
    const int streams[3][2] = {{K_STDIN, K_FIRST_STDIN}, {K_STDOUT, K_FIRST_STDOUT}, {K_STDERR, K_FIRST_STDERR}};
    for (int i = 0; i < 3; i++) {
        PyObject *first = sys_now(streams[i][1]);
        sys_set(streams[i][0], first != NULL ? first : Py_None);
    }
}

/* _PyModule_ClearDict for a module still alive, walking the live dict as it does (a finaliser that
 * runs sees the names not reached yet): names with one leading underscore None first, then every
 * other but __builtins__. */
static void clear_module_dict(PyObject *ns) {
    for (int single = 1; single >= 0; single--) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(ns, &pos, &key, &value)) {
            if (value == Py_None || !PyUnicode_Check(key)) continue;
            Py_ssize_t n = PyUnicode_GET_LENGTH(key);
            Py_UCS4 c0 = n > 0 ? PyUnicode_READ_CHAR(key, 0) : 0, c1 = n > 1 ? PyUnicode_READ_CHAR(key, 1) : 0;
            if (single ? !(c0 == '_' && c1 != '_') : (c0 == '_' && PyUnicode_CompareWithASCIIString(key, "__builtins__") == 0))
                continue;
            if (PyDict_SetItem(ns, key, Py_None) < 0) PyErr_Clear();
        }
    }
}

/* The threads running Python besides this one: the interpreter's thread states, counted here (a
 * program can replace what threading would say; a fork leaves only the forking thread's). */
static long other_threads(void) {
    PyThreadState *self = PyThreadState_Get();
    long count = 0;
    for (PyThreadState *t = PyInterpreterState_ThreadHead(self->interp); t != NULL; t = PyThreadState_Next(t))
        count += t != self;
    return count;
}

/* _PySignal_Fini: a signal the program handles in Python goes back to its default before the
 * finalisers run, and its handler is let go of (a SIGALRM that comes then ends the process, and
 * what the handler held, __main__'s globals through a function of its, can die, as there). */
static void signals_off(void) {
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        /* Python's own table, read without a system call: a callable is a handler of Python's. */
        PyObject *h = PyObject_CallFunction(get_signal, "i", sig);
        int python = h != NULL && !PyLong_Check(h) && h != Py_None && PyCallable_Check(h);
        Py_XDECREF(h);
        PyErr_Clear();
        if (!python) continue;
        PyObject *r = PyObject_CallFunction(set_signal, "ii", sig, 0 /* SIG_DFL */);
        if (r == NULL) PyOS_setsig(sig, SIG_DFL);
        Py_XDECREF(r);
        PyErr_Clear();
    }
}

/* _PyGC_CollectNoFail: a full collection, whatever gc.disable() said, without calling gc.callbacks
 * (taken out for it and put back after: a finaliser that runs meanwhile sees the list empty, where
 * Python's own, which skips them, leaves it as it is). */
static void collect_no_fail(void) {
    PyObject *kept = NULL;
    if (PyList_Check(gc_callbacks) && PyList_GET_SIZE(gc_callbacks) > 0) {
        kept = PyList_GetSlice(gc_callbacks, 0, PyList_GET_SIZE(gc_callbacks));
        if (kept == NULL || PyList_SetSlice(gc_callbacks, 0, PyList_GET_SIZE(gc_callbacks), NULL) < 0) {
            Py_XDECREF(kept);
            PyErr_Clear();
            return; /* not run with them: none is better than a collection Python would not make */
        }
    }
    int was = PyGC_Enable();
    PyGC_Collect();
    if (!was) PyGC_Disable();
    PyErr_Clear();
    if (kept != NULL) {
        if (PyList_SetSlice(gc_callbacks, 0, 0, kept) < 0) PyErr_Clear();
        Py_DECREF(kept);
    }
}

/* The end of a run in module `main` (its reference stolen): `e` how it ended, `first` the standard
 * streams it started with (stolen; flushed at the very end, as Python destroys them), `script`
 * whether it ran from its main file. Never returns. */
static void end_run(ending e, PyObject *main, PyObject *first[3], int script) {
    flush_io();
    int by_exit = 0;
    int status = e.type == NULL ? 0 : status_of(e, &by_exit);
    drop_ending(&e);
    PyObject *ns = PyModule_GetDict(main); /* borrowed: `main` holds it */
    /* _PyRun_SimpleFileObject: a script's __file__ and __cached__ go once it has run, unless it
     * ended by SystemExit (Py_Exit finalises from within PyErr_Print, before that). */
    if (script && !by_exit && ns != NULL) {
        if (PyDict_DelItem(ns, names[K_FILE]) < 0) PyErr_Clear();
        if (PyDict_DelItem(ns, names[K_CACHED]) < 0) PyErr_Clear();
    }
    /* Py_FinalizeEx: wait_for_thread_shutdown, only where the program imported threading. */
    PyObject *threading = PyImport_GetModule(names[K_THREADING]);
    if (threading != NULL) {
        PyObject *r = PyObject_CallMethodNoArgs(threading, names[K_SHUTDOWN]);
        if (r == NULL) write_unraisable(threading);
        Py_XDECREF(r);
        Py_DECREF(threading);
    }
    PyErr_Clear();
    PyObject *r = PyObject_CallNoArgs(run_exitfuncs);
    Py_XDECREF(r);
    PyErr_Clear();
    int flushed = flush_std_files();
    signals_off();
    PyGC_Collect(); /* as Python's end: only where gc is enabled */
    PyErr_Clear();
    /* finalize_modules: __main__ out of sys.modules and let go of. Its dict dies as garbage (a
     * cycle through its functions and classes), every finaliser running with the globals in
     * place (PEP 442), as in Python; a module something else still holds is cleared in place. The
     * other modules are left as they are (tearing them all down would cost every action). */
    delete_special();
    PyObject *modules = PyImport_GetModuleDict();
    if (PyDict_SetItem(modules, names[K_MAIN], Py_None) < 0) PyErr_Clear();
    PyObject *alive = PyWeakref_NewRef(main, NULL);
    Py_DECREF(main);
    if (alive == NULL) PyErr_Clear();
    collect_no_fail();
    PyObject *still = alive != NULL ? PyWeakref_GetObject(alive) : NULL;
    /* Not while other threads run: Python stops them first (they never take the interpreter again),
     * and one that went on would find its globals gone. */
    if (still != NULL && still != Py_None && PyModule_Check(still) && other_threads() == 0) {
        Py_INCREF(still);
        PyObject *dict = PyModule_GetDict(still);
        Py_XINCREF(dict);
        if (dict != NULL) clear_module_dict(dict);
        Py_XDECREF(dict);
        Py_DECREF(still);
        collect_no_fail();
    }
    Py_XDECREF(alive);
    /* The streams the program started with, destroyed at Python's very end, which flushes what
     * was written to them (errors unsaid, as there). */
    for (int i = 0; i < 3; i++) {
        if (first[i] != NULL && !is_closed(first[i]) && !flush_stream(first[i])) PyErr_Clear();
        Py_XDECREF(first[i]);
    }
    fflush(NULL); /* what C code of the program left in stdio's buffers, as exit(3) writes it */
    if (status == BY_SIGINT) {
        signal(SIGINT, SIG_DFL);
        kill(getpid(), SIGINT);
        status = 130; /* SIGINT blocked: what Python's exit_sigint then returns */
    } else if (!flushed) {
        status = 120;
    }
    _exit(status);
}

/* No Python frame under the program's: as under `python main.py`, its module's frame is the first
 * (`sys._getframe().f_back` is None, a warning's stacklevel=2 names `sys`, an error reported at the
 * end shows no frame of the agent's). Only where nothing returns to the frames below. */
static void detach_frames(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyThreadState_Get()->current_frame = NULL;
#elif PY_VERSION_HEX >= 0x030B0000
    PyThreadState_Get()->cframe->current_frame = NULL;
#endif
}

/* Run a code object (NULL: what made it failed, its exception set) in `ns`: how it ended. */
static ending evaluate(PyObject *code, PyObject *ns) {
    /* The program starts as deep as under `python main.py`, where its module is the first frame:
     * the frames below it (the zygote's entry and loop, and in the Python loop the child's) would
     * otherwise count against the recursion limit, and a recursion 995 to 998 deep that passes
     * outside would fail here. Nothing returns to those frames, so the count is not restored. */
    full_recursion_budget();
    PyObject *done = code ? PyEval_EvalCode(code, ns, ns) : NULL;
    if (done != NULL) {
        Py_DECREF(done);
        return (ending){NULL, NULL};
    }
    return fetch_ending();
}

/* The module the program runs in: a fresh __main__ of this process, with `prepared`'s names (the
 * zygote's, frozen, would never be garbage: its finalisers could not run as Python runs them). In
 * Python's order of a script's globals. */
static PyObject *fresh_main(PyObject *prepared) {
    PyObject *main = PyModule_NewObject(names[K_MAIN]);
    PyObject *ns = main != NULL ? PyModule_GetDict(main) : NULL;
    if (ns == NULL) child_fail("the main module");
    const int order[] = {K_NAME, K_DOC, K_PACKAGE, K_LOADER, K_SPEC, K_ANNOTATIONS, K_BUILTINS, K_FILE, K_CACHED};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        PyObject *value = PyDict_GetItemWithError(prepared, names[order[i]]);
        if (value != NULL && PyDict_SetItem(ns, names[order[i]], value) < 0) child_fail("the main module");
    }
    if (PyErr_Occurred() || PyDict_Merge(ns, prepared, 0) < 0) child_fail("the main module");
    PyObject *modules = PyImport_GetModuleDict();
    if (PyDict_SetItem(modules, names[K_MAIN], main) < 0) child_fail("the main module");
    return main;
}

/* Run a code object in `main` (fresh_main's) to its end (end_run). Never returns. */
static void run_to_end(PyObject *code, PyObject *main, int script) { /* `main` stolen */
    PyObject *first[3] = {sys_held(K_FIRST_STDIN), sys_held(K_FIRST_STDOUT), sys_held(K_FIRST_STDERR)};
    detach_frames();
    ending e = evaluate(code, PyModule_GetDict(main));
    end_run(e, main, first, script);
}

/* A session's persistent interpreter (child._interpreter_loop, whose Python loop serves where this
 * module is not built): each call's code runs in the same globals, and its status goes back on the
 * control socket as one answer (wire.SESSION_ANSWER: the call's token, the status). All of it here,
 * for the reasons end_run gives, and because the program shares this process: from Python a call
 * could read its token (the loop's frame) and write the answer itself, or replace what computes
 * the status, and pass a call that failed. Nothing secret travels on the control socket once the
 * session's code may run (the code can read ahead of the loop there, MSG_PEEK): an answer counts
 * for a call only with the MAC of its nonce and status under the interpreter's key, which is read
 * first, before any of the session's code runs, and held in a C variable only. An answer written
 * by another process (a helper the program left to pass the
 * true one on, changed) is refused by its sender's pid (SCM_CREDENTIALS, forkserver._on_ctrl),
 * and descriptor 3 must still be the socket the session started with (ctrl_intact), or a socket
 * of the program's there would feed the loop requests and take its answers. Python code of the
 * agent's still runs before each call (`prepare`: its stdin, cores, environment, shadowed
 * modules): replaced, it can make a call fail or end the interpreter, which fails the call. */
/* SipHash-2-4 (Aumasson and Bernstein) of `len` bytes under a 16-byte key: wire.siphash24's twin. */
static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

#define ROTL64(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                              \
    do {                                                                                                      \
        v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32);                                         \
        v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2;                                                              \
        v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0;                                                              \
        v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32);                                         \
    } while (0)

static uint64_t siphash24(const unsigned char key[16], const unsigned char *in, size_t len) {
    uint64_t k0 = le64(key), k1 = le64(key + 8);
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    size_t whole = len - len % 8;
    for (size_t i = 0; i < whole; i += 8) {
        uint64_t m = le64(in + i);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t last = (uint64_t)(len & 0xff) << 56;
    for (size_t i = 0; i < len % 8; i++) last |= (uint64_t)in[whole + i] << (8 * i);
    v3 ^= last;
    SIPROUND;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* The interpreter's key (wire.SESSION_KEY_SIZE), read from the control socket before any of the
 * session's code runs, and held here only: in no Python object, at no time. */
static unsigned char session_key[16];
static pid_t session_pid;  /* the interpreter's own: a process its call forked is another */
static struct stat ctrl_is; /* what the control socket is: a descriptor 3 the program put there is not */

/* Descriptor `ctrl` is still the control socket the session started with, blocking (the program
 * shares it: it may make it non-blocking, or put a socket of its own there, from which requests of
 * its making would come, and to which the loop's answer would go for it to pass on changed). */
static int ctrl_intact(int ctrl) {
    struct stat now;
    if (fstat(ctrl, &now) < 0 || now.st_dev != ctrl_is.st_dev || now.st_ino != ctrl_is.st_ino) return 0;
    int flags = fcntl(ctrl, F_GETFL);
    return flags >= 0 && ((flags & O_NONBLOCK) == 0 || fcntl(ctrl, F_SETFL, flags & ~O_NONBLOCK) == 0);
}

static int serve_call(int ctrl, PyObject *ns, PyObject *prepare, int devnull) { /* 0: served; 1: closed; -1 */
    if (!ctrl_intact(ctrl)) return -1;
    unsigned char header[12]; /* wire.SESSION_CALL: the request's length, the call's nonce */
    struct iovec iov = {header, sizeof header};
    union {
        char buf[CMSG_SPACE(3 * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
    ssize_t got;
    do
        got = recvmsg(ctrl, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (got < 0 && errno == EINTR);
    if (got == 0) return 1; /* the manager closed its end: done */
    if (got < (ssize_t)sizeof header) return -1;
    int fds[3], nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            if (nfds > 3) nfds = 3;
            memcpy(fds, CMSG_DATA(c), (size_t)nfds * sizeof(int));
        }
    uint32_t length;
    int64_t nonce; /* the call's, public: its answer carries it back */
    memcpy(&length, header, sizeof length);
    memcpy(&nonce, header + sizeof length, sizeof nonce);
    unsigned char *payload = length > 0 && length <= (1u << 30) ? malloc(length) : NULL;
    if (payload == NULL) return -1;
    for (uint32_t done = 0; done < length;) {
        ssize_t n = recv(ctrl, payload + done, length - done, 0);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            free(payload);
            return -1;
        }
        done += (uint32_t)n;
    }
    PyObject *request = PyMarshal_ReadObjectFromString((const char *)payload, (Py_ssize_t)length);
    free(payload);
    if (request == NULL || !PyDict_Check(request)) return -1;
    PyObject *source = PyDict_GetItemWithError(request, names[K_CODE]); /* the request's "code" */
    if (source == NULL) return -1;
    Py_INCREF(source);
    for (int i = 0; i < nfds; i++) {
        if (fds[i] == i) continue; /* already in place (0-2 closed by the program, then reused) */
        dup2(fds[i], i);
        close(fds[i]);
    }
    PyObject *ready = PyObject_CallOneArg(prepare, request);
    Py_DECREF(request);
    if (ready == NULL) { /* said on the call's stderr; the interpreter ends, which fails the call */
        PyObject *failed = raised_exception();
        if (failed != NULL) PyErr_Display((PyObject *)Py_TYPE(failed), failed, Py_None);
        Py_XDECREF(failed);
        return -1;
    }
    Py_DECREF(ready);
    PyObject *args = PyTuple_Pack(3, source, names[K_STRING], names[K_EXEC]);
    PyObject *kwargs = args != NULL ? PyDict_New() : NULL;
    if (kwargs == NULL || PyDict_SetItem(kwargs, names[K_DONT_INHERIT], Py_True) < 0) return -1;
    /* As `python -c` compiles it: not with this module's caller's future flags (dont_inherit). */
    PyObject *code = PyObject_Call(compile_source, args, kwargs);
    Py_DECREF(args);
    Py_DECREF(kwargs);
    Py_DECREF(source);
    ending e = evaluate(code, ns);
    Py_XDECREF(code);
    flush_io();
    int by_exit = 0;
    int status = e.type == NULL ? 0 : status_of(e, &by_exit);
    drop_ending(&e);
    if (status == BY_SIGINT) status = 1; /* a KeyboardInterrupt ends the call, not the session */
    flush_std_files();
    /* What this call printed to the streams it started with and then rebound goes with its output,
     * not a later call's. */
    const int pairs[2][2] = {{K_FIRST_STDOUT, K_STDOUT}, {K_FIRST_STDERR, K_STDERR}};
    for (int i = 0; i < 2; i++) {
        PyObject *first = sys_held(pairs[i][0]);
        if (first != NULL && first != sys_now(pairs[i][1]) && !is_closed(first) && !flush_stream(first))
            PyErr_Clear();
        Py_XDECREF(first);
    }
    fflush(NULL);
    /* A process the call forked that ran on to its end (`if os.fork() == 0: ...` falling through):
     * it ends there, as under `python -c`, and answers nothing. */
    if (getpid() != session_pid) _exit(status & 0xFF);
    for (int i = 0; i < 3; i++) dup2(devnull, i);
    /* Checked last, with nothing between here and the answer that runs Python (which could let a
     * thread of the program's swap the descriptor again). */
    if (!ctrl_intact(ctrl)) return -1;
    unsigned char answer[20]; /* wire.SESSION_ANSWER, little-endian: nonce, status, their MAC */
    int32_t st = (int32_t)status;
    memcpy(answer, &nonce, sizeof nonce);
    memcpy(answer + sizeof nonce, &st, sizeof st);
    uint64_t mac = siphash24(session_key, answer, sizeof nonce + sizeof st);
    memcpy(answer + sizeof nonce + sizeof st, &mac, sizeof mac);
    ssize_t sent;
    do
        sent = send(ctrl, answer, sizeof answer, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    return sent == (ssize_t)sizeof answer ? 0 : -1;
}

/* Python code compiled by the manager, written to its main file: run it here, as `python main.py`
 * would, and end (run_to_end). The same as child.py's _run_python_and_exit, without the Python
 * function calls in between: each of those wrote pages of its own (frames, reference counts, the
 * interpreter's per-instruction counters) and every page written is a copy-on-write fault in the
 * child. Never returns. */
static void run_straight(const char *main_file, const unsigned char *compiled, uint32_t cblen,
                         const unsigned char *delta, uint32_t dlen) {
    put_environ(delta, dlen);
    PyObject *file = PyUnicode_DecodeFSDefault(main_file);
    const char *slash = strrchr(main_file, '/');
    PyObject *dir = PyUnicode_DecodeFSDefaultAndSize(main_file, slash ? slash - main_file : 0);
    PyObject *main_ns = PyModule_GetDict(run_main);
    if (file == NULL || dir == NULL || PyDict_SetItem(main_ns, names[K_FILE], file) < 0)
        child_fail("the main module");
    /* __loader__ as `python main.py` has it: a SourceFileLoader of its file (child._main_loader). */
    PyObject *loader = source_loader ? PyObject_CallFunctionObjArgs(source_loader, names[K_MAIN], file, NULL) : NULL;
    if (loader == NULL || PyDict_SetItem(main_ns, names[K_LOADER], loader) < 0) PyErr_Clear();
    Py_XDECREF(loader);
    /* sys.argv becomes [main_file]: the zygote's list (python -c's ['-c']) is reused in place. */
    PyObject *argv = sys_get(K_ARGV);
    if (argv != NULL && PyList_CheckExact(argv) && PyList_GET_SIZE(argv) == 1) {
        if (PyList_SetItem(argv, 0, Py_NewRef(file)) < 0) child_fail("the main module");
    } else {
        argv = PyList_New(1);
        if (argv == NULL) child_fail("the main module");
        PyList_SET_ITEM(argv, 0, Py_NewRef(file));
        if (PyDict_SetItem(sys_dict, names[K_ARGV], argv) < 0) child_fail("the main module");
        Py_DECREF(argv);
    }
    PyObject *path = sys_get(K_PATH);
    if (path != NULL && PyList_Check(path) && PyList_GET_SIZE(path) > 0 && PyList_SetItem(path, 0, Py_NewRef(dir)) < 0)
        child_fail("the main module");
    PyObject *modules = sys_get(K_MODULES);
    PyObject *numpy = modules ? PyDict_GetItem(modules, names[K_NUMPY]) : NULL;
    if (numpy != NULL) {
        /* numpy's global generator is not reseeded at fork, unlike the random module's. */
        PyObject *random = PyObject_GetAttr(numpy, names[K_RANDOM]);
        if (random != NULL) call_method(random, K_SEED);
        Py_XDECREF(random);
        PyErr_Clear();
    }
    /* This child's copy of the zygote's reference is the run's: none other may keep __main__ alive. */
    PyObject *main = run_main;
    run_main = NULL;
    mark_setup(0, 1);
    run_to_end(PyMarshal_ReadObjectFromString((const char *)compiled, (Py_ssize_t)cblen), main, 1);
}

/* (kind, code, argv, env_delta, ctrl_fd, main_file, compiled) for the child's Python side. */
static PyObject *child_result(int interp, const unsigned char *code, uint32_t clen, const unsigned char *argv,
                              uint32_t alen, const unsigned char *delta, uint32_t dlen, const char *main_file,
                              const unsigned char *compiled, uint32_t cblen) {
    /* Compiled code needs no source text (tracebacks read the main file): no str to build. */
    PyObject *py_code = main_file && cblen ? Py_NewRef(Py_None)
                                           : PyUnicode_DecodeUTF8((const char *)code, (Py_ssize_t)clen, "surrogatepass");
    PyObject *py_main = main_file ? PyUnicode_DecodeFSDefault(main_file) : Py_NewRef(Py_None);
    /* A view of the request's bytes (this copy of them is the child's): no copy to fault in. */
    PyObject *py_compiled = main_file && cblen ? PyMemoryView_FromMemory((char *)compiled, (Py_ssize_t)cblen, PyBUF_READ)
                                               : Py_NewRef(Py_None);
    PyObject *py_argv = alen ? strings(argv, alen) : Py_NewRef(Py_None);
    PyObject *pairs = strings(delta, dlen);
    PyObject *result = NULL;
    if (py_code && py_argv && pairs && py_main && py_compiled) {
        Py_ssize_t n = PyTuple_GET_SIZE(pairs);
        PyObject *py_delta = PyTuple_New(n);
        for (Py_ssize_t k = 0; py_delta != NULL && k < n; k++) {
            PyObject *item = PyTuple_GET_ITEM(pairs, k);
            Py_ssize_t eq = PyUnicode_FindChar(item, '=', 0, PyUnicode_GET_LENGTH(item), 1);
            PyObject *pair = eq < 0 ? Py_BuildValue("(OO)", item, Py_None)
                                    : Py_BuildValue("(NN)", PyUnicode_Substring(item, 0, eq),
                                                    PyUnicode_Substring(item, eq + 1, PyUnicode_GET_LENGTH(item)));
            if (pair == NULL) {
                Py_CLEAR(py_delta);
                break;
            }
            PyTuple_SET_ITEM(py_delta, k, pair);
        }
        if (py_delta != NULL)
            result = Py_BuildValue("(sOONiOO)", interp ? "interp" : "run", py_code, py_argv, py_delta, interp ? 3 : -1,
                                   py_main, py_compiled);
    }
    Py_XDECREF(py_main);
    Py_XDECREF(py_compiled);
    Py_XDECREF(py_code);
    Py_XDECREF(py_argv);
    Py_XDECREF(pairs);
    return result;
}

static unsigned char *read_memfd(int fd, uint64_t size) {
    if (size == 0 || size > (1ull << 31)) return NULL;
    unsigned char *buf = malloc(size);
    if (buf == NULL) return NULL;
    uint64_t got = 0;
    while (got < size) {
        ssize_t n = pread(fd, buf + got, size - got, (off_t)got);
        if (n <= 0) {
            free(buf);
            return NULL;
        }
        got += (uint64_t)n;
    }
    return buf;
}

/* Move a child just forked (on this loop's core) to its action's cores, from here. The child moves
 * itself too (child_setup), but a running task cannot move itself at once: it waits until the
 * kernel's stopper thread on this core has pushed it over, time its own core sits idle (measured:
 * the child blocked in sched_setaffinity for about 4 in 10 actions at c=16). A child not yet
 * running is moved by a runqueue change, without waiting; its own call then finds the mask set.
 * Errors are the child's to report (its own call fails the same way). */
static void place_child(pid_t pid, const int32_t *cores, uint32_t ncores) {
    if (ncores == 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (uint32_t i = 0; i < ncores; i++) {
        if (cores[i] < 0 || cores[i] >= CPU_SETSIZE) return;
        CPU_SET(cores[i], &set);
    }
    sched_setaffinity(pid, sizeof set, &set);
}

/* One request: returns 1 in a child (its result set), 0 in the zygote, -1 when the manager left. */

/* A request the zygote cannot fork for: its descriptors closed, its buffer freed, an error record
 * sent. Returns 0 (the loop goes on). */
static int drop_request(int sock, int64_t id, const char *what, int err, int netns_fd, int mntns_fd, int *fds,
                        int nfds, void *big) {
    if (netns_fd >= 0) close(netns_fd);
    if (mntns_fd >= 0) close(mntns_fd);
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(big);
    send_error(sock, id, what, err);
    return 0;
}
static int on_request(int sock, int ep, int pid_namespace, int own_pidns, int devnull, PyObject **result) {
    struct iovec iov = {dgram, sizeof dgram};
    char control[CMSG_SPACE(MAX_FDS * sizeof(int))];
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) return errno == EINTR || errno == EAGAIN ? 0 : -1;
    if (n == 0) return -1;
    int fds[MAX_FDS + 1];
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count && nfds < MAX_FDS; i++) memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
    }
    const unsigned char *data = dgram;
    size_t size = (size_t)n;
    unsigned char *big = NULL;
    int64_t id = -1;
    if (n >= 12) memcpy(&id, dgram + 4, 8);
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        for (int i = 0; i < nfds; i++) close(fds[i]);
        send_error(sock, id, "the request was cut short", EMSGSIZE);
        return 0;
    }
    if (n >= 20 && memcmp(dgram, "TZRM", 4) == 0 && nfds > 0) {
        uint64_t total;
        memcpy(&total, dgram + 12, 8);
        int memfd = fds[--nfds];
        big = read_memfd(memfd, total);
        close(memfd);
        if (big == NULL) {
            for (int i = 0; i < nfds; i++) close(fds[i]);
            send_error(sock, id, "reading the request", EIO);
            return 0;
        }
        data = big;
        size = (size_t)total;
    }
    reader r = {data, data + size, 0};
    char magic[4];
    int32_t uid;
    uint32_t flags, ncores, nlimits, wlen, elen;
    take(&r, magic, 4);
    take(&r, &id, 8);
    take(&r, &uid, 4);
    take(&r, &flags, 4);
    take(&r, &ncores, 4);
    const unsigned char *cores_at = r.p;
    if (!r.bad && ncores <= 1024 && (size_t)(r.end - r.p) >= ncores * 4u) r.p += ncores * 4u;
    else r.bad = 1;
    take(&r, &nlimits, 4);
    const unsigned char *limits = r.p;
    if (!r.bad && nlimits <= 16 && (size_t)(r.end - r.p) >= nlimits * 12u) r.p += nlimits * 12u;
    else r.bad = 1;
    const unsigned char *workdir = take_span(&r, &wlen);
    const unsigned char *env = take_span(&r, &elen);
    uint32_t dlen, clen, alen;
    const unsigned char *delta = take_span(&r, &dlen);
    const unsigned char *code = take_span(&r, &clen);
    const unsigned char *argv = take_span(&r, &alen);
    uint32_t mlen = 0, cblen = 0;
    const unsigned char *main_file = NULL, *compiled = NULL;
    if (flags & 16u) {
        main_file = take_span(&r, &mlen);
        compiled = take_span(&r, &cblen);
    }
    int interp = (int)(flags & 1u);
    if (r.bad || memcmp(magic, "TZR1", 4) != 0 || wlen == 0 || workdir[wlen - 1] != '\0' ||
        (elen > 0 && env[elen - 1] != '\0') || (dlen > 0 && delta[dlen - 1] != '\0') ||
        (alen > 0 && argv[alen - 1] != '\0') || (main_file != NULL && (mlen < 2 || main_file[mlen - 1] != '\0')) ||
        (interp ? nfds < 1 : nfds < 2))
        return drop_request(sock, id, "malformed request", EINVAL, -1, -1, fds, nfds, big);
    int32_t cores[1024];
    memcpy(cores, cores_at, ncores * 4u);
    int netns_fd = -1, mntns_fd = -1;
    if ((flags & 4u) && nfds > (interp ? 1 : 2)) netns_fd = fds[--nfds];
    if ((flags & 8u) && nfds > (interp ? 1 : 2)) mntns_fd = fds[--nfds];

    unsigned char *flag = new_setup_flag();
    if (flag == NULL) return drop_request(sock, id, "the set-up flag", errno, netns_fd, mntns_fd, fds, nfds, big);
    if (pid_namespace && syscall(SYS_unshare, CLONE_NEWPID) < 0) {
        int err = errno;
        free_setup_flag(flag);
        return drop_request(sock, id, "unshare(CLONE_NEWPID)", err, netns_fd, mntns_fd, fds, nfds, big);
    }
    pid_t init_pid = -1;
    void *init_stack = NULL;
#ifdef CHEAP_INIT
    if (pid_namespace && !interp) {
        /* The namespace's first process, so its init: the action comes second (see the header). */
        init_stack = take_stack();
        if (init_stack != NULL)
            init_pid = clone(ns_init, (char *)init_stack + INIT_STACK, CLONE_VM | SIGCHLD, NULL);
        if (init_pid < 0) {
            int err = errno;
            if (init_stack != NULL) give_stack(init_stack);
            free_setup_flag(flag);
            setns(own_pidns, CLONE_NEWPID);
            return drop_request(sock, id, "clone (the namespace's init)", err, netns_fd, mntns_fd, fds, nfds, big);
        }
    }
#endif
    PyOS_BeforeFork();
    pid_t pid = fork();
    if (pid == 0) {
        PyOS_AfterFork_Child();
        setup_flag = flag;
        /* The action's own network namespace (loopback up), made ahead by the manager. */
        if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) < 0) child_fail("setns(network)");
        /* Its own /tmp and /dev/shm: a mount namespace the manager made ahead (see forkserver). */
        if (mntns_fd >= 0 && setns(mntns_fd, CLONE_NEWNS) < 0) child_fail("setns(mount)");
        child_setup(interp, fds, nfds, devnull, uid, cores, ncores, limits, nlimits, (const char *)workdir,
                    (const char *)env, elen, (flags & 2u) != 0, (flags & 32u) != 0, (flags & 64u) != 0,
                    (flags & 128u) != 0, init_pid > 0);
        const char *written = NULL;
        if (main_file != NULL && !interp && alen == 0 && write_main((const char *)main_file, code, clen))
            written = (const char *)main_file;
        if (written != NULL && cblen > 0 && run_namespace != NULL)
            run_straight(written, compiled, cblen, delta, dlen);
        *result = child_result(interp, code, clen, argv, alen, delta, dlen, written, compiled, cblen);
        if (*result == NULL) child_fail("building the request's objects");
        return 1;
    }
    int err = errno;
    if (pid > 0) place_child(pid, cores, ncores);
    PyOS_AfterFork_Parent();
    if (pid_namespace) setns(own_pidns, CLONE_NEWPID); /* only one child may be a namespace's init */
    if (netns_fd >= 0) close(netns_fd);
    if (mntns_fd >= 0) close(mntns_fd);
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(big);
    int pidfd = -1, init_pidfd = -1;
    if (pid >= 0) {
        pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pidfd < 0 || pidfd >= MAX_PIDFD) {
            err = pidfd < 0 ? errno : EMFILE;
            if (pidfd >= 0) close(pidfd);
            pidfd = -1;
        }
    }
    if (pidfd >= 0 && init_pid > 0) {
        init_pidfd = (int)syscall(SYS_pidfd_open, init_pid, 0);
        if (init_pidfd < 0 || init_pidfd >= MAX_PIDFD) {
            err = init_pidfd < 0 ? errno : EMFILE;
            if (init_pidfd >= 0) close(init_pidfd);
            init_pidfd = -1;
        }
    }
    if (pid < 0 || pidfd < 0 || (init_pid > 0 && init_pidfd < 0)) {
        /* No fork, or out of descriptors: nothing may run untracked. */
        if (pid > 0) kill(pid, SIGKILL);
        if (init_pid > 0) kill(init_pid, SIGKILL);
        if (pid > 0)
            while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
            }
        if (init_pid > 0) {
            while (waitpid(init_pid, NULL, __WALL) < 0 && errno == EINTR) {
            }
            give_stack_if(init_stack);
        }
        if (pidfd >= 0) close(pidfd);
        free_setup_flag(flag);
        send_error(sock, id, pid < 0 ? "fork" : "pidfd_open", err);
        return 0;
    }
    kid *k = &kids[pidfd];
    memset(k, 0, sizeof *k);
    k->pid = pid;
    k->init_pidfd = init_pidfd;
    k->flag = flag;
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = pidfd};
    epoll_ctl(ep, EPOLL_CTL_ADD, pidfd, &ev);
    if (init_pidfd >= 0) {
        kid *ki = &kids[init_pidfd];
        memset(ki, 0, sizeof *ki);
        ki->pid = init_pid;
        ki->is_init = 1;
        ki->action_pidfd = pidfd;
        ki->init_pidfd = -1;
        ki->stack = init_stack;
        struct epoll_event iev = {.events = EPOLLIN, .data.fd = init_pidfd};
        epoll_ctl(ep, EPOLL_CTL_ADD, init_pidfd, &iev);
    }
    unsigned char rec[13];
    rec[0] = 'S';
    memcpy(rec + 1, &id, 8);
    int32_t pid32 = pid;
    memcpy(rec + 9, &pid32, 4);
    send_record(sock, rec, sizeof rec, pidfd);
    return 0;
}

static void send_exit(int sock, const kid *k) {
    unsigned char rec[26];
    rec[0] = 'X';
    int32_t pid32 = k->pid;
    memcpy(rec + 1, &pid32, 4);
    memcpy(rec + 5, &k->status, 4);
    memcpy(rec + 9, &k->cpu_s, 8);
    memcpy(rec + 17, &k->max_rss_kb, 8);
    rec[25] = (unsigned char)(k->setup_failed != 0);
    send_record(sock, rec, sizeof rec, -1);
}

static void on_exit_of(int sock, int ep, int pidfd) {
    kid *k = &kids[pidfd];
    int status = 0;
    struct rusage ru;
    memset(&ru, 0, sizeof ru);
    pid_t got = wait4(k->pid, &status, WNOHANG | (k->is_init ? __WALL : 0), &ru);
    if (got == 0) return; /* not yet reapable (the pidfd said it exited: should not happen) */
    epoll_ctl(ep, EPOLL_CTL_DEL, pidfd, NULL);
    if (k->is_init) {
        /* The namespace is empty now. The action's pidfd was kept open until here, so that its
         * number (its slot in kids) is not reused while its record waits. */
        close(pidfd);
        give_stack_if(k->stack);
        int apidfd = k->action_pidfd;
        kid *action = &kids[apidfd];
        action->init_pidfd = -1;
        if (action->exited) {
            close(apidfd);
            send_exit(sock, action);
        }
        return;
    }
    k->status = got < 0 ? -1 : status;
    k->cpu_s = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
               ru.ru_stime.tv_usec / 1e6;
    k->max_rss_kb = ru.ru_maxrss;
    if (k->flag != NULL) {
        /* Final now: the byte is the child's alone, and it has exited (see setup_flag). Its own
         * end, too: a child killed during its set-up (a timeout of a millisecond) was killed. */
        k->setup_failed = *(volatile unsigned char *)k->flag != 0 && got > 0 && WIFEXITED(status) &&
                          WEXITSTATUS(status) == SETUP_FAILED;
        free_setup_flag(k->flag);
        k->flag = NULL;
    }
    if (k->init_pidfd >= 0) {
        /* Whatever the action left in its namespace goes with the init; the record waits for it. */
        k->exited = 1;
        syscall(SYS_pidfd_send_signal, k->init_pidfd, SIGKILL, NULL, 0);
        return;
    }
    close(pidfd);
    send_exit(sock, k);
}

static PyObject *zygote_serve(PyObject *self, PyObject *args) {
    int sock, pid_namespace, own_pidns, devnull;
    PyObject *ns = NULL, *env = NULL, *filter = NULL;
    if (!PyArg_ParseTuple(args, "iiii|OOO", &sock, &pid_namespace, &own_pidns, &devnull, &ns, &env, &filter))
        return NULL;
    if (filter != NULL && filter != Py_None) {
        if (!PyBytes_Check(filter) || PyBytes_GET_SIZE(filter) == 0 ||
            PyBytes_GET_SIZE(filter) % (Py_ssize_t)sizeof(struct sock_filter) != 0 ||
            PyBytes_GET_SIZE(filter) / (Py_ssize_t)sizeof(struct sock_filter) > BPF_MAXINSNS) {
            PyErr_SetString(PyExc_ValueError, "serve: the seccomp filter must be bytes of whole sock_filter entries");
            return NULL;
        }
        /* Kept for the process's life: every child installs it. */
        size_t size = (size_t)PyBytes_GET_SIZE(filter);
        struct sock_filter *copy = malloc(size);
        if (copy == NULL) return PyErr_NoMemory();
        memcpy(copy, PyBytes_AS_STRING(filter), size);
        seccomp_prog.len = (unsigned short)(size / sizeof(struct sock_filter));
        seccomp_prog.filter = copy;
    }
    if (ns != NULL && ns != Py_None) {
        if (!PyDict_Check(ns) || env == NULL || !PyDict_Check(env)) {
            PyErr_SetString(PyExc_TypeError, "serve: namespace and environ data must be dicts");
            return NULL;
        }
        /* Kept for the process's life (the children's copies are theirs). */
        run_namespace = Py_NewRef(ns);
        environ_data = Py_NewRef(env);
        if (prepare_names() < 0) return NULL;
        /* Made here, after the zygote's gc.freeze: young in every child, so its dict can die as
         * garbage at a run's end; and made once, not in each child (about 20 pages written). */
        if ((run_main = fresh_main(run_namespace)) == NULL) return NULL;
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return PyErr_SetFromErrno(PyExc_OSError);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = sock};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, sock, &ev) < 0) {
        close(ep);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(ep, events, 64, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == sock) {
                PyObject *result = NULL;
                int got = on_request(sock, ep, pid_namespace, own_pidns, devnull, &result);
                if (got == 1) return result; /* in the child: ep went with close_range */
                if (got < 0) {
                    close(ep);
                    Py_RETURN_NONE;
                }
            } else {
                on_exit_of(sock, ep, fd);
            }
        }
    }
    close(ep);
    Py_RETURN_NONE;
}

/* What the zygote calls through ctypes where the loop is Python's: with this loop it imports no
 * ctypes (nor libffi), whose memory and mappings every fork would copy and every exit tear down. */
static PyObject *zygote_die_with_parent(PyObject *self, PyObject *unused) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* Signals 32 and 33 (glibc's own, for thread cancellation and set*id across threads) back to their
 * default, as every program outside has them: the agent starts this process with posix_spawn, whose
 * helper leaves them ignored, and ignored they stayed in every action and what it executes (`kill
 * -s 33 $$` killed a shell outside and not here). glibc's sigaction refuses them, so this is the
 * kernel's; glibc installs its own handlers when it needs them, whatever they were. */
static PyObject *zygote_default_reserved_signals(PyObject *self, PyObject *unused) {
    for (int sig = 32; sig <= 33; sig++) {
        unsigned long act[4] = {(unsigned long)SIG_DFL, 0, 0, 0}; /* handler, flags, restorer, mask */
        if (syscall(SYS_rt_sigaction, sig, act, NULL, 8) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *zygote_mark_setup(PyObject *self, PyObject *args) {
    int running, unmap;
    if (!PyArg_ParseTuple(args, "pp", &running, &unmap)) return NULL;
    mark_setup(running, unmap);
    Py_RETURN_NONE;
}

static PyObject *zygote_malloc_trim(PyObject *self, PyObject *unused) {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    Py_RETURN_NONE;
}

/* child._run_code's (a session's call, or a child without this module's end): the program it runs
 * starts with the whole budget (see run_to_end). Nothing returns below it in a child but the loops
 * that run the code, which only gain by it. */
static PyObject *zygote_fresh_recursion(PyObject *self, PyObject *unused) {
    full_recursion_budget();
    Py_RETURN_NONE;
}

/* child._finish_and_exit's: what C code of the program wrote through stdio (printf, puts: ctypes, an
 * extension) and left in its buffers, written out as exit(3) would; the child ends with _exit. */
static PyObject *zygote_flush_stdio(PyObject *self, PyObject *unused) {
    fflush(NULL);
    Py_RETURN_NONE;
}

/* child._run_python_and_exit's: run_to_end for a code object the child compiled (or unmarshalled),
 * in the Python loop and in the C loop's children that did not take the straight path, in a fresh
 * __main__ made from `namespace`; `script`: run from its main file. */
static PyObject *zygote_run_to_end(PyObject *self, PyObject *args) {
    PyObject *code, *ns;
    int script;
    if (!PyArg_ParseTuple(args, "O!O!p", &PyCode_Type, &code, &PyDict_Type, &ns, &script)) return NULL;
    if (prepare_names() < 0) return NULL;
    run_to_end(Py_NewRef(code), fresh_main(ns), script);
    return NULL; /* never reached */
}

/* child._run_python_and_exit's: the end of a run whose code could not be compiled (a SyntaxError),
 * its exception raised before the program's first line, so with no traceback. */
static PyObject *zygote_end_with(PyObject *self, PyObject *args) {
    PyObject *exc, *ns;
    int script;
    if (!PyArg_ParseTuple(args, "OO!p", &exc, &PyDict_Type, &ns, &script)) return NULL;
    if (!PyExceptionInstance_Check(exc)) {
        PyErr_SetString(PyExc_TypeError, "end_with: an exception instance is needed");
        return NULL;
    }
    if (prepare_names() < 0) return NULL;
    PyObject *first[3] = {sys_held(K_FIRST_STDIN), sys_held(K_FIRST_STDOUT), sys_held(K_FIRST_STDERR)};
    PyObject *main = fresh_main(ns);
    detach_frames();
    end_run((ending){Py_NewRef((PyObject *)Py_TYPE(exc)), Py_NewRef(exc)}, main, first, script);
    return NULL; /* never reached */
}

/* zygote_wire.IDENTITY_FILES, told once at start: (name in the workdir root, file it covers). */

/* child._interpreter_loop's: serve a session's calls on control descriptor `ctrl` until the manager
 * closes it (serve_call: 1), then exit 0; 1 where a call could not be served. Never returns. */
static PyObject *zygote_serve_session(PyObject *self, PyObject *args) {
    int ctrl;
    PyObject *ns, *prepare;
    if (!PyArg_ParseTuple(args, "iO!O", &ctrl, &PyDict_Type, &ns, &prepare)) return NULL;
    if (prepare_names() < 0) return NULL;
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0) return PyErr_SetFromErrno(PyExc_OSError);
    session_pid = getpid();
    if (fstat(ctrl, &ctrl_is) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    /* Not dumpable: /proc/self/mem then belongs to root, and the session's code cannot read the key
     * out of this process's memory with file I/O (an agent running as root has this already, from
     * the change of uid; one that is not would leave it readable). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    for (size_t got = 0; got < sizeof session_key;) {
        ssize_t n = recv(ctrl, session_key + got, sizeof session_key - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) _exit(0); /* the fork server went before the first call */
        got += (size_t)n;
    }
    detach_frames(); /* the call's code runs with no frame of the agent's under it (never returned to) */
    int served;
    while ((served = serve_call(ctrl, ns, prepare, devnull)) == 0) {
    }
    _exit(served > 0 ? 0 : 1);
}

/* siphash24(key, data): for the test that the loop's MAC is the fork server's (wire.siphash24). */
static PyObject *zygote_siphash24(PyObject *self, PyObject *args) {
    Py_buffer key, data;
    if (!PyArg_ParseTuple(args, "y*y*", &key, &data)) return NULL;
    PyObject *r = NULL;
    if (key.len != 16)
        PyErr_SetString(PyExc_ValueError, "siphash24: the key is 16 bytes");
    else
        r = PyLong_FromUnsignedLongLong(siphash24(key.buf, data.buf, (size_t)data.len));
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return r;
}

static PyObject *zygote_set_identity(PyObject *self, PyObject *pairs) {
    if (!PyTuple_Check(pairs) || PyTuple_GET_SIZE(pairs) > IDENTITY_MAX) {
        PyErr_SetString(PyExc_ValueError, "set_identity: a tuple of at most 4 (name, path) pairs");
        return NULL;
    }
    int n = (int)PyTuple_GET_SIZE(pairs);
    for (int i = 0; i < n; i++) {
        const char *name, *path;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(pairs, i), "ss", &name, &path)) return NULL;
        if (strlen(name) >= IDENTITY_NAME_MAX || strlen(path) >= IDENTITY_NAME_MAX) {
            PyErr_SetString(PyExc_ValueError, "set_identity: a name or path of 64 bytes or more");
            return NULL;
        }
        strcpy(identity[i][0], name);
        strcpy(identity[i][1], path);
    }
    n_identity = n;
    Py_RETURN_NONE;
}

static PyObject *zygote_set_tmp_files(PyObject *self, PyObject *args) {
    long long per, least;
    if (!PyArg_ParseTuple(args, "LL", &per, &least)) return NULL;
    if (per < 0 || least < 0) {
        PyErr_SetString(PyExc_ValueError, "set_tmp_files: negative bytes per file or files");
        return NULL;
    }
    tmp_bytes_per_file = per;
    tmp_min_files = least;
    Py_RETURN_NONE;
}

/* What ipc_bounds makes of `size`: the tests hold it to child.ipc_bounds, its twin. */
static PyObject *zygote_ipc_bounds(PyObject *self, PyObject *args) {
    long long size, shm_pages, queues, sems;
    if (!PyArg_ParseTuple(args, "L", &size)) return NULL;
    ipc_bounds(size, &shm_pages, &queues, &sems);
    return Py_BuildValue("(LLL)", shm_pages, queues, sems);
}

/* What tmp_options makes of `size`: the tests hold it to child.tmp_options, its twin. */
static PyObject *zygote_tmp_options(PyObject *self, PyObject *args) {
    long long size;
    if (!PyArg_ParseTuple(args, "L", &size)) return NULL;
    char opts[128];
    tmp_options(opts, sizeof opts, size);
    return PyUnicode_FromString(opts);
}

/* See isolation.few_malloc_arenas (the Python loop's twin), which says why. */
static PyObject *zygote_few_malloc_arenas(PyObject *self, PyObject *unused) {
#ifdef __GLIBC__
    mallopt(M_ARENA_MAX, 2);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"serve", zygote_serve, METH_VARARGS, "Run the zygote's fork loop (see the module's source)."},
    {"die_with_parent", zygote_die_with_parent, METH_NOARGS, "prctl(PR_SET_PDEATHSIG, SIGKILL)."},
    {"default_reserved_signals", zygote_default_reserved_signals, METH_NOARGS, "Signals 32 and 33 to SIG_DFL."},
    {"mark_setup", zygote_mark_setup, METH_VARARGS, "A child's set-up flag: (running, unmap); see setup_flag."},
    {"malloc_trim", zygote_malloc_trim, METH_NOARGS, "Give freed heap back to the system (glibc)."},
    {"few_malloc_arenas", zygote_few_malloc_arenas, METH_NOARGS, "mallopt(M_ARENA_MAX, 2) (glibc)."},
    {"fresh_recursion", zygote_fresh_recursion, METH_NOARGS, "The thread's whole recursion budget."},
    {"flush_stdio", zygote_flush_stdio, METH_NOARGS, "fflush(NULL): C stdio's buffers, as exit(3) does."},
    {"run_to_end", zygote_run_to_end, METH_VARARGS, "Run a code object in a namespace and end as python does."},
    {"end_with", zygote_end_with, METH_VARARGS, "End a run with an exception raised before its code ran."},
    {"serve_session", zygote_serve_session, METH_VARARGS, "Serve a session's calls on its control socket."},
    {"siphash24", zygote_siphash24, METH_VARARGS, "SipHash-2-4 of data under a 16-byte key."},
    {"set_identity", zygote_set_identity, METH_O, "The identity files to bind (zygote_wire.IDENTITY_FILES)."},
    {"set_tmp_files", zygote_set_tmp_files, METH_VARARGS, "Files per byte of a private /tmp (child.tmp_options)."},
    {"tmp_options", zygote_tmp_options, METH_VARARGS, "A private /tmp's mount options (child.tmp_options)."},
    {"ipc_bounds", zygote_ipc_bounds, METH_VARARGS, "An action's System V bounds (child.ipc_bounds)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_zygote", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__zygote(void) { return PyModule_Create(&module); }
