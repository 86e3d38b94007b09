/*
 * bb-dormant: a checkpoint that runs nothing (loaded by the REPL as
 * /.branchbox/bb-dormant.so, see agent/checkpointing.py).
 *
 * A checkpoint is a fork of the REPL kept for later: a restore or a fork of
 * the checkpoint forks it again. If that kept process ran Python after its
 * fork, every object it touched would copy a page (reference counts live in
 * the objects), a few MiB per checkpoint. So the fork is made here, in C,
 * and the kept process never returns to the interpreter. It must hold
 * nothing of its sandbox, which goes on running (and may be replaced by a
 * restore). It moves itself into the checkpoint's cgroup; points the fds the
 * daemon listed at /dev/null and closes every other (a socket kept open here
 * would hide the REPL's end from the daemon); makes shared memory its own
 * (anonymous memory is copied into private memory, so the REPL's later writes
 * do not change the instant; a file's mapping is left a placeholder, mapped
 * again from the checkpoint's frozen layer when it is woken); leaves the
 * sandbox's mount, network, IPC and UTS namespaces for its own, whose root is
 * a small tmpfs with only the checked device nodes a woken process binds into
 * its /dev, the directory it attaches its root at, and an empty proc (see
 * empty_proc); says it is ready, and then only waits on its socket. Each
 * message it receives is a wake: it forks once more, and that process lets go
 * of the socket and returns to Python with the message and its fds, to become
 * a sandbox as any fork child does (its shared memory is made shared again
 * once it is in its own cgroup, so the copy is charged there).
 *
 * No libc: raw system calls only, so the library loads into any image's
 * python3 (as bb-init runs on any image, being static).
 *
 * Protocol on SOCK (SOCK_SEQPACKET, the daemon at the other end), each
 * answer 8 bytes (a native int64):
 *   - after set-up: 0 (ready) or -errno (and the process exits);
 *   - a 1-byte message "?" without fds: ALIVE;
 *   - any other message (up to BUF_MAX bytes, up to FDS_MAX fds): the pid of
 *     the woken process, or -errno if it could not be forked;
 *   - end of file: the process exits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/mman.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <linux/mount.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include "bb_syscall.h"

#define BUF_MAX 65536
#define FDS_MAX 64
#define ALIVE (1L << 62) /* not a pid, not -errno */
#define ROOT "/.branchbox/root" /* where its tmpfs root is built, then pivoted into */

#ifndef SYS_open_tree
#define SYS_open_tree 428
#define SYS_move_mount 429
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#endif

static void copy_bytes(char *dst, const char *src, unsigned long n) {
    /* volatile: no compiler turns this loop back into a call to libc's memcpy */
    volatile char *d = dst;
    while (n--)
        *d++ = *src++;
}

/* Whole pages, a word at a time (shared memory may be large). */
static void copy_pages(unsigned long dst, unsigned long src, unsigned long n) {
    volatile unsigned long *d = (unsigned long *)dst;
    const unsigned long *from = (const unsigned long *)src;
    for (n /= sizeof(unsigned long); n; n--)
        *d++ = *from++;
}

static void answer(int sock, int64_t value) {
    while (SYS(sendto, sock, &value, sizeof value) == -EINTR)
        ;
}

static __attribute__((noreturn)) void quit(int sock, long err) {
    answer(sock, err);
    for (;;)
        SYS(exit_group, 1, 0, 0);
}

/* Clone with fork semantics, child of our parent (the family's init reaps it). */
static long fork_flat(void) {
    return sys6(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0, 0);
}

/*
 * COPIES: for each shared mapping to make our own, the words
 *   start, length, prot, nruns, then nruns pairs (offset, size)
 * of the runs of pages to copy (the caller found them: pages in memory); or
 *   start, length, prot, -1
 * for a file's mapping, which becomes an inaccessible placeholder (the file
 * is mapped again from the checkpoint's frozen layer when it is woken).
 */
static long make_private(const long *copies, long words) {
    long i = 0;
    while (i + 4 <= words) {
        unsigned long start = copies[i], length = copies[i + 1];
        long prot = copies[i + 2], nruns = copies[i + 3];
        i += 4;
        if (nruns == -1) {
            long held = sys6(SYS_mmap, start, length, PROT_NONE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
            if (held < 0 && held > -4096)
                return held;
            continue;
        }
        if (nruns < 0 || i + 2 * nruns > words)
            return -EINVAL;
        long fresh = sys6(SYS_mmap, 0, length, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (fresh < 0 && fresh > -4096)
            return fresh;
        /* One that cannot be made readable stays zeros. */
        int readable = (prot & PROT_READ) ||
                       SYS(mprotect, start, length, prot | PROT_READ) == 0;
        for (long r = 0; r < nruns && readable; r++) {
            unsigned long offset = copies[i + 2 * r], size = copies[i + 2 * r + 1];
            if (offset < length && size <= length - offset)
                copy_pages(fresh + offset, start + offset, size);
        }
        i += 2 * nruns;
        if (prot != (PROT_READ | PROT_WRITE))
            SYS(mprotect, fresh, length, prot);
        long moved = sys6(SYS_mremap, fresh, length, length,
                          MREMAP_MAYMOVE | MREMAP_FIXED, start, 0);
        if (moved < 0 && moved > -4096)
            return moved;
    }
    return 0;
}

/* The device nodes a sandbox's /dev binds (entry.py's _DEVICES): major 1. */
static const struct {
    const char *path, *target;
    long minor;
} devices[] = {{"/dev/null", "dev/null", 3},     {"/dev/zero", "dev/zero", 5},
               {"/dev/full", "dev/full", 7},     {"/dev/random", "dev/random", 8},
               {"/dev/urandom", "dev/urandom", 9}};

/* A copy of the mount at DIRFD/PATH attached at TARGET (relative to the
   current directory, which exists). */
static long attach_copy(long dirfd, const char *path, long flags, const char *target) {
    long tree = SYS(open_tree, dirfd, path, OPEN_TREE_CLONE | O_CLOEXEC | flags);
    if (tree < 0)
        return tree;
    long err = sys6(SYS_move_mount, tree, (long)"", AT_FDCWD, (long)target,
                    MOVE_MOUNT_F_EMPTY_PATH, 0);
    SYS(close, tree, 0, 0);
    return err;
}

/* Bind the sandbox's device node at PATH onto TARGET if it is that character
   device; the node is checked and bound through one fd, so nothing can swap
   it in between. */
static long bind_device(const char *path, const char *target, long minor) {
    struct stat st;
    long fd = sys6(SYS_openat, AT_FDCWD, (long)path, O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, 0, 0);
    if (fd < 0)
        return fd;
    long err = SYS(fstat, fd, &st, 0);
    if (err == 0 && (!S_ISCHR(st.st_mode) || st.st_rdev != (unsigned long)((1 << 8) | minor)))
        err = -ENODEV;
    if (err == 0) {
        err = sys6(SYS_openat, AT_FDCWD, (long)target, O_CREAT | O_WRONLY | O_CLOEXEC, 0666,
                   0, 0);
        if (err >= 0)
            SYS(close, err, 0, 0);
    }
    if (err >= 0)
        err = attach_copy(fd, "", AT_EMPTY_PATH, target);
    SYS(close, fd, 0, 0);
    return err;
}

/* A proc of a PID namespace of its own, empty once its init has mounted it and
   exited: a woken process's bb-init may mount a proc only where one is fully
   visible, and the sandbox's own would show its live processes (their roots and
   namespaces) to the woken process's Python before it enters its sandbox. */
static long empty_proc(const char *target) {
    long pid = sys6(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0, 0);
    if (pid == 0) {
        long err = sys6(SYS_mount, (long)"proc", (long)target, (long)"proc",
                        MS_NOSUID | MS_NODEV | MS_NOEXEC, 0, 0);
        for (;;)
            SYS(exit_group, err ? 1 : 0, 0, 0);
    }
    if (pid < 0)
        return pid;
    int status = 0;
    long got;
    do
        got = sys6(SYS_wait4, pid, (long)&status, 0, 0, 0, 0);
    while (got == -EINTR);
    if (got < 0)
        return got;
    return status == 0 ? 0 : -EPERM;
}

/* Close every fd from 3 up but SOCK and those in KEEP (ascending): the REPL's fds
   the daemon listed are /dev/null by now; anything else (past the daemon's list, or
   opened by a before-fork hook after it was read) goes. */
static void close_others(int sock, const int *keep, int n) {
    unsigned long low = 3;
    int sock_done = sock < 3;
    for (int k = 0; k <= n; k++) {
        unsigned long next = k < n ? (unsigned long)keep[k] : ~0UL;
        if (k < n && keep[k] < 3)
            continue;
        if (!sock_done && (unsigned long)sock < next) {
            if ((unsigned long)sock >= low) {
                if ((unsigned long)sock > low)
                    SYS(close_range, low, sock - 1, 0);
                low = sock + 1;
            }
            sock_done = 1;
        }
        if (next == ~0UL) {
            SYS(close_range, low, ~0U, 0);
            return;
        }
        if (next >= low) {
            if (next > low)
                SYS(close_range, low, next - 1, 0);
            low = next + 1;
        }
    }
}

/* Namespaces and a root of its own (see the top of this file). */
static long own_root(void) {
    long err = SYS(unshare, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS, 0, 0);
    if (!err)
        err = sys6(SYS_mount, 0, (long)"/", 0, MS_REC | MS_PRIVATE, 0, 0);
    if (!err)
        err = sys6(SYS_mount, (long)"tmpfs", (long)ROOT, (long)"tmpfs",
                   MS_NOSUID | MS_NOEXEC, (long)"size=64k,mode=755", 0);
    if (!err)
        err = SYS(chdir, ROOT, 0, 0);
    static const char *dirs[] = {".branchbox", ".branchbox/root", "dev", "proc", "old"};
    for (unsigned k = 0; !err && k < sizeof dirs / sizeof *dirs; k++)
        err = SYS(mkdirat, AT_FDCWD, dirs[k], 0755);
    for (unsigned k = 0; !err && k < sizeof devices / sizeof *devices; k++)
        err = bind_device(devices[k].path, devices[k].target, devices[k].minor);
    if (!err)
        err = empty_proc("proc");
    if (!err)
        err = SYS(pivot_root, ".", "old", 0);
    if (!err)
        err = SYS(chdir, "/", 0, 0);
    if (!err)
        err = SYS(umount2, "/old", MNT_DETACH, 0);
    if (!err)
        err = SYS(unlinkat, AT_FDCWD, "/old", AT_REMOVEDIR);
    return err;
}

/* Wait for wakes; returns (0) only in a process forked for one. */
static long serve(int sock, char *buf, long cap, int *fds, int maxfds, long *got) {
    static char message[BUF_MAX];
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(sizeof(int) * FDS_MAX)];
    } control;
    for (;;) {
        struct iovec iov = {message, sizeof message};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.space;
        msg.msg_controllen = sizeof control.space;
        long n = SYS(recvmsg, sock, &msg, MSG_CMSG_CLOEXEC);
        if (n == -EINTR)
            continue;
        if (n <= 0)
            for (;;)
                SYS(exit_group, 0, 0, 0);
        int nfds = 0, *passed = NULL;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            passed = (int *)CMSG_DATA(c);
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        }
        long pid;
        if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC) || n > cap || nfds > maxfds)
            pid = -EMSGSIZE;
        else if (n == 1 && message[0] == '?')
            pid = nfds ? -EINVAL : ALIVE;
        else
            pid = fork_flat();
        if (pid == 0) {
            /* Before any Python runs (the interpreter's after-fork hooks are the
               sandbox's code): the checkpoint's socket is not this process's to
               keep. (Its memory is the checkpoint's copy-on-write: its writes are
               its own.) */
            SYS(close, sock, 0, 0);
            copy_bytes(buf, message, (unsigned long)n);
            for (int k = 0; k < nfds; k++)
                fds[k] = passed[k];
            got[0] = n;
            got[1] = nfds;
            return 0;
        }
        for (int k = 0; k < nfds; k++)
            SYS(close, passed[k], 0, 0);
        answer(sock, pid);
    }
}

/*
 * Called by the REPL (single-threaded, the interpreter's before-fork hooks
 * run). Returns here with the checkpoint's pid, or -errno; and, in every
 * process forked from the checkpoint for a wake, 0, with the wake's message
 * in BUF (got[0] bytes) and its fds in FDS (got[1] of them).
 *
 * JOIN: cgroup.procs fds of the checkpoint's cgroups (written "0", closed).
 * NULLIFY: the REPL's other fds (from 3 up, ascending), pointed at /dev/null;
 * any fd not listed is closed.
 * COPIES: its shared memory, see make_private.
 */
long bb_dormant(int sock, const int *join, int njoin, const int *nullify, int nnull,
                const long *copies, long words, char *buf, long cap, int *fds, int maxfds,
                long *got) {
    long pid = fork_flat();
    if (pid != 0)
        return pid;
    for (int k = 0; k < njoin; k++) {
        long err = SYS(write, join[k], "0", 1);
        if (err < 0)
            quit(sock, err);
        SYS(close, join[k], 0, 0);
    }
    long null = sys6(SYS_openat, AT_FDCWD, (long)"/dev/null", O_RDWR | O_CLOEXEC, 0, 0, 0);
    if (null < 0)
        quit(sock, null);
    for (int k = 0; k < nnull; k++)
        if (nullify[k] != sock && nullify[k] != null && nullify[k] > 2)
            SYS(dup3, null, nullify[k], O_CLOEXEC);
    SYS(close, null, 0, 0);
    close_others(sock, nullify, nnull);
    long err = make_private(copies, words);
    if (err < 0)
        quit(sock, err);
    /* The instant is kept: the daemon may let the sandbox run on. Leaving its
       namespaces comes after (a wake waits in the socket meanwhile); if that
       fails, the process ends, and the checkpoint is found gone when used. */
    answer(sock, 0);
    if (own_root() < 0)
        for (;;)
            SYS(exit_group, 1, 0, 0);
    return serve(sock, buf, cap, fds, maxfds, got);
}
