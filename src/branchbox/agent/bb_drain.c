/*
 * bb-drain: the thread that drains a run_code's output pipes (loaded by the REPL as
 * /.branchbox/bb-drain.so, see agent/capture.py).
 *
 * During a call the REPL's fds 1 and 2 are pipes, and something must read them
 * while user code runs, or a writer blocks once a pipe is full. A Python thread
 * did it, but starting one and handing the GIL to it and back cost each call
 * ~0.15 ms, a tenth of a run_code round trip. This thread is plain C: it never
 * takes the GIL, so it costs a clone and a futex wake.
 *
 * bb_drain_start() starts it on a struct bb_drain the caller filled in and keeps
 * until bb_drain_join() returns. Until a byte arrives on STOP it reads every pipe
 * in FDS: the first OWN of them are the call's own (the first KEEP bytes of each
 * go into its memory file FILES[i], the rest are counted in DROPPED), the others
 * are earlier calls' pipes that a process still writes into (read and dropped).
 * After STOP it reads what is there already (at most FINAL_DRAIN bytes) and ends.
 * OPEN[i] says, at the end, whether pipe i still has writers: 1 yes, 0 end of file,
 * -1 not ours any more (user code closed that fd, or the number is another file's
 * now: each read first checks it is still the same pipe). If a memory
 * file cannot take more (user code may set RLIMIT_FSIZE), the rest is dropped: the
 * pipes are drained whatever happens, or a writer would block.
 *
 * The thread has a stack of its own (made once per process), all signals blocked
 * (they are the interpreter's, in its main thread), and no thread-local storage:
 * raw system calls only, no libc, as bb_dormant.c. It exists only during a call, so
 * the REPL is single-threaded whenever the daemon forks it.
 *
 * x86_64 only for now (bb_drain_native() says so): elsewhere the REPL drains with a
 * Python thread as before.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include "bb_syscall.h"

#define BB_DRAIN_MAX 64
#define READ_SIZE 65536
#define STACK_SIZE (256 * 1024) /* the read buffer, the poll set and a few frames */

struct bb_drain {
    int nfds;
    int own;
    int stop;
    int tid; /* the thread's id while it runs: the kernel clears it at its exit */
    long keep;
    long final_drain;
    long dropped;
    long error; /* -errno if polling or writing a memory file failed, else 0 */
    int fds[BB_DRAIN_MAX];
    int files[BB_DRAIN_MAX];
    long kept[BB_DRAIN_MAX];
    int open[BB_DRAIN_MAX];
};

#if defined(__x86_64__)
static char *stack; /* this process's; a fork child has its own copy */

/* The pipes' identities when the call began (one drain at a time per process). */
static unsigned long pipe_dev[BB_DRAIN_MAX], pipe_ino[BB_DRAIN_MAX];

static int same_pipe(const struct bb_drain *d, int i) {
    struct stat st;
    return SYS(fstat, d->fds[i], &st, 0) == 0 && st.st_dev == pipe_dev[i] &&
           st.st_ino == pipe_ino[i];
}

static long write_all(int fd, const char *data, long n) {
    while (n > 0) {
        long done = SYS(write, fd, data, n);
        if (done == -EINTR)
            continue;
        if (done < 0)
            return done;
        data += done;
        n -= done;
    }
    return 0;
}

static void drain(struct bb_drain *d) {
    char buf[READ_SIZE];
    struct pollfd set[BB_DRAIN_MAX + 1];
    int which[BB_DRAIN_MAX];
    int stopping = 0;
    long after = 0;
    for (;;) {
        int n = 0;
        for (int i = 0; i < d->nfds; i++) {
            if (d->open[i] == 1) {
                set[n].fd = d->fds[i];
                set[n].events = POLLIN;
                set[n].revents = 0;
                which[n++] = i;
            }
        }
        if (n == 0)
            return; /* every pipe has lost its writers */
        int pipes = n;
        if (!stopping) {
            set[n].fd = d->stop;
            set[n].events = POLLIN;
            set[n].revents = 0;
            n++;
        }
        long ready = SYS(poll, set, n, stopping ? 0 : -1);
        if (ready == -EINTR || ready == -ENOMEM || ready == -EAGAIN)
            continue; /* never stop draining while a writer may wait on us */
        if (ready < 0) {
            d->error = ready;
            return;
        }
        if (stopping && (ready == 0 || after > d->final_drain))
            return;
        if (!stopping && set[pipes].revents) {
            stopping = 1;
            continue; /* then read what is there already, without waiting */
        }
        for (int k = 0; k < pipes; k++) {
            if (!set[k].revents)
                continue;
            int i = which[k];
            if (!same_pipe(d, i)) { /* closed, and maybe the number reused, by user code */
                d->open[i] = -1;
                continue;
            }
            long got = SYS(read, d->fds[i], buf, READ_SIZE);
            if (got == -EINTR || got == -EAGAIN)
                continue;
            if (got <= 0) { /* end of file (no writer is left), or not ours any more */
                d->open[i] = got == 0 ? 0 : -1;
                continue;
            }
            if (stopping)
                after += got;
            if (i >= d->own)
                continue; /* an earlier call's writer: dropped */
            long room = d->keep - d->kept[i];
            if (room > got)
                room = got;
            if (room > 0 && !d->error) {
                long err = write_all(d->files[i], buf, room);
                if (err < 0)
                    d->error = err; /* kept no more: dropped from now on */
                else
                    d->kept[i] += room;
            }
            if (room < 0 || d->error)
                room = 0;
            d->dropped += got - room;
        }
    }
}

static void thread_main(void *arg) { drain((struct bb_drain *)arg); }

/*
 * long clone_thread(long flags, char *stack_top, int *tid, void (*fn)(void *), void *arg):
 * a thread that runs fn(arg) on stack_top and exits; the caller gets its id. fn and
 * arg ride on the new stack, since the child returns from clone with nothing but it.
 */
long clone_thread(long flags, char *stack_top, int *tid, void (*fn)(void *), void *arg);
__asm__(".text\n"
        ".globl clone_thread\n"
        ".hidden clone_thread\n"
        ".type clone_thread,@function\n"
        "clone_thread:\n"
        "    and $-16, %rsi\n"
        "    sub $16, %rsi\n"
        "    mov %rcx, 8(%rsi)\n"  /* fn */
        "    mov %r8, (%rsi)\n"    /* arg */
        "    mov %rdx, %r10\n"     /* child_tid: cleared and woken at the thread's exit */
        "    xor %r8d, %r8d\n"     /* tls: none (the thread touches none) */
        "    mov $56, %eax\n"      /* clone(flags, stack, parent_tid, child_tid, tls) */
        "    syscall\n"
        "    test %rax, %rax\n"
        "    jnz 1f\n"
        "    xor %ebp, %ebp\n"
        "    pop %rdi\n"
        "    pop %rax\n"
        "    call *%rax\n"
        "    mov $60, %eax\n"      /* exit: this thread only */
        "    xor %edi, %edi\n"
        "    syscall\n"
        "    hlt\n"
        "1:  ret\n"
        ".size clone_thread, .-clone_thread\n");
#endif

long bb_drain_native(void) {
#if defined(__x86_64__)
    return 1;
#else
    return 0;
#endif
}

long bb_drain_start(struct bb_drain *d) {
#if defined(__x86_64__)
    if (d->nfds < 0 || d->nfds > BB_DRAIN_MAX || d->own < 0 || d->own > d->nfds)
        return -EINVAL;
    if (!stack) {
        long got = sys6(SYS_mmap, 0, STACK_SIZE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (got < 0)
            return got;
        stack = (char *)got;
    }
    for (int i = 0; i < d->nfds; i++) {
        struct stat st;
        long err = SYS(fstat, d->fds[i], &st, 0);
        d->open[i] = err == 0 ? 1 : -1;
        pipe_dev[i] = err == 0 ? st.st_dev : 0;
        pipe_ino[i] = err == 0 ? st.st_ino : 0;
    }
    uint64_t all = ~(uint64_t)0, old;
    /* The thread starts with the caller's mask: every signal blocked, for that moment. */
    sys6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, (long)&old, 8, 0, 0);
    long tid = clone_thread(CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD |
                                CLONE_SYSVSEM | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID,
                            stack + STACK_SIZE, &d->tid, thread_main, d);
    sys6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, 8, 0, 0);
    return tid < 0 ? tid : 0;
#else
    (void)d;
    return -ENOSYS;
#endif
}

long bb_drain_join(struct bb_drain *d) {
    for (;;) {
        int tid = __atomic_load_n(&d->tid, __ATOMIC_ACQUIRE);
        if (!tid)
            return d->error;
        sys6(SYS_futex, (long)&d->tid, FUTEX_WAIT, tid, 0, 0, 0);
    }
}
