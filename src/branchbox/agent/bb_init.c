/*
 * bb-init: a sandbox's command PID namespace (Q), its init, and the spawner
 * that starts every command in it.
 *
 * Started by the sandbox's REPL with posix_spawn (vfork + exec): a fork
 * would copy the page tables of the whole REPL, which for a REPL holding a
 * gigabyte of Python objects costs as much as the fork of the REPL itself.
 * Statically linked, so it runs on any image.
 *
 *   bb-init PROC_DIR READY_FD SPAWN_FD [CGROUP_FD...]
 *   bb-init --reap        (a family's init: reap orphans forever, nothing else)
 *   bb-init --launcher INIT_PID CONN_FD HOME_FD   (a family's launcher, see launcher())
 *
 * Why a spawner: the REPL stays in its family's PID namespace P and never
 * changes its own pid_for_children, so P can belong to the host's user
 * namespace, where sandbox root has no capability: no process of a family
 * can mount a proc of P (which would show, and open the files and memory
 * of, every sibling branch) or setns into it. This process is the one that
 * unshares Q, and it keeps Q as its pid_for_children for good.
 *
 * 1. dies with the REPL that started it (which tears down every command);
 * 2. joins the sandbox's commands cgroup (fds opened by the daemon), which
 *    every command it starts inherits;
 * 3. unshares Q and forks Q's init, which mounts /proc for Q at PROC_DIR
 *    (only a process inside Q can: a proc mount shows the PID namespace of
 *    the process that mounts it), then reaps orphans forever;
 * 4. writes one NUL byte to READY_FD (or an error message);
 * 5. serves SPAWN_FD (SOCK_SEQPACKET): each message carries four fds —
 *    stdin, stdout, stderr, and a memfd holding "cwd\0file\0argc\0argv...\0env...\0"
 *    (file: the program to exec; empty: argv[0], looked up on the command's PATH) —
 *    and is answered with "pid errno step" once the command has exec'd (pid
 *    > 0) or failed (step 1: chdir, 2: exec), with a pidfd of the command
 *    (SCM_RIGHTS) when it runs. Commands are cloned with CLONE_PARENT, so
 *    they are the REPL's children (it waits for them, through that pidfd:
 *    pidfd_open is refused in every sandbox, see confine.py) and, being born
 *    here, live in Q. The REPL's user code can send requests too:
 *    they start processes in the same sandbox, nothing more, and a malformed
 *    one is refused.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_REQUEST (8 << 20) /* argv + env: above the kernel's ARG_MAX default */
#define MAX_STRINGS 65536

extern char **environ;
static int ready_fd = -1;

static int fail(const char *what) {
    dprintf(ready_fd, "%s: %s", what, strerror(errno));
    return 1;
}

static void close_from(int low) {
    syscall(SYS_close_range, low, ~0U, 0);
}

/* Be a PID namespace's init: hold no fd, reap every orphan, never return. */
static void reap_forever(void) {
    for (int fd = 0; fd < 3; fd++)
        close(fd);
    close_from(3);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    for (;;) {
        int sig;
        sigwait(&chld, &sig);
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
    }
}

static void q_init(const char *proc_dir, int status_w) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (mount("proc", proc_dir, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) {
        dprintf(status_w, "mounting /proc: %s", strerror(errno));
        _exit(1);
    }
    if (write(status_w, "", 1) != 1)
        _exit(1);
    reap_forever();
}

/* Split a request (cwd, the file to exec or "", argc in decimal, argc arguments, then
 * KEY=VALUE strings, each NUL-terminated) into cwd, file, argv and envp (pointers into
 * buf); 0 if malformed. The count, not an empty string, ends argv: an empty argument is
 * a legitimate one. */
static int parse(char *buf, size_t len, char **cwd, char **file, char ***argv,
                 char ***envp) {
    if (len == 0 || buf[len - 1] != '\0')
        return 0;
    size_t count = 0;
    for (size_t i = 0; i < len; i++)
        count += buf[i] == '\0';
    if (count < 4 || count > MAX_STRINGS)
        return 0;
    char *p = buf, *end = buf + len;
    *cwd = p;
    p += strlen(p) + 1;
    *file = p;
    p += strlen(p) + 1;
    char *digits_end;
    errno = 0;
    unsigned long argc = strtoul(p, &digits_end, 10);
    if (errno || *p < '0' || *p > '9' || *digits_end != '\0' || argc == 0 ||
        argc > count - 3)
        return 0;
    p = digits_end + 1;
    char **list = calloc(count + 2, sizeof(char *));
    if (!list)
        return 0;
    size_t n = 0;
    *argv = list;
    for (unsigned long i = 0; i < argc; i++)
        list[n++] = p, p += strlen(p) + 1;
    list[n++] = NULL;
    *envp = list + n;
    while (p < end)
        list[n++] = p, p += strlen(p) + 1;
    list[n] = NULL;
    return 1;
}

static void child(int fds[4], int err_w, char *cwd, char *file, char **argv,
                  char **envp) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid(); /* its own session and process group: a kill reaches all it started */
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0)
            _exit(127);
    if (isatty(0))
        ioctl(0, TIOCSCTTY, 0); /* a terminal (a PTY command): its controlling one, for ^C */
    if (dup2(err_w, 3) < 0)
        _exit(127);
    fcntl(3, F_SETFD, FD_CLOEXEC);
    close_from(4);
    int step = 1;
    if (chdir(cwd) == 0) {
        step = 2;
        environ = envp;
        if (*file)
            execve(file, argv, envp);
        else
            execvp(argv[0], argv);
    }
    int report[2] = {errno, step};
    if (write(3, report, sizeof report) < 0)
        _exit(127);
    _exit(127);
}

static void answer(int sock, long pid, int err, int step, int pidfd) {
    char line[64];
    int n = snprintf(line, sizeof line, "%ld %d %d", pid, err, step);
    struct iovec iov = {line, (size_t)n};
    struct msghdr msg = {0};
    char control[CMSG_SPACE(sizeof(int))];
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (pidfd >= 0) {
        memset(control, 0, sizeof control);
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &pidfd, sizeof(int));
    }
    sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (pidfd >= 0)
        close(pidfd);
}

static void spawn_one(int sock, int fds[4]) {
    struct stat st;
    char *buf = NULL, *cwd, *file, **argv, **envp;
    if (fstat(fds[3], &st) != 0 || st.st_size <= 0 || st.st_size > MAX_REQUEST ||
        !(buf = malloc(st.st_size))) {
        answer(sock, -1, EINVAL, 0, -1);
        return;
    }
    if (pread(fds[3], buf, st.st_size, 0) != st.st_size ||
        !parse(buf, st.st_size, &cwd, &file, &argv, &envp)) {
        free(buf);
        answer(sock, -1, EINVAL, 0, -1);
        return;
    }
    int err[2];
    if (pipe2(err, O_CLOEXEC) != 0) {
        answer(sock, -1, errno, 0, -1);
        free(buf);
        free(argv);
        return;
    }
    int pidfd = -1; /* CLONE_PIDFD puts it where clone's parent_tid points */
    long pid = syscall(SYS_clone, CLONE_PARENT | CLONE_PIDFD | SIGCHLD, 0, &pidfd, 0, 0);
    if (pid == 0) {
        close(err[0]);
        child(fds, err[1], cwd, file, argv, envp);
    }
    int saved = errno;
    close(err[1]);
    int report[2] = {0, 0};
    if (pid < 0) {
        report[0] = saved;
    } else {
        ssize_t got;
        do
            got = read(err[0], report, sizeof report);
        while (got < 0 && errno == EINTR);
        if (got != sizeof report)
            report[0] = report[1] = 0; /* EOF: the exec happened */
    }
    close(err[0]);
    free(buf);
    free(argv);
    if (pid < 0 || report[0]) { /* no command runs: nothing to wait for through it */
        if (pidfd >= 0)
            close(pidfd);
        pidfd = -1;
    }
    answer(sock, pid, report[0], report[1], pidfd);
}

static void serve(int sock) {
    for (;;) {
        char byte;
        char control[CMSG_SPACE(8 * sizeof(int))];
        struct iovec iov = {&byte, 1};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            _exit(0); /* the REPL is gone */
        int fds[8], nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (int i = 0; i < n && nfds < 8; i++)
                memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
        if (nfds == 4 && !(msg.msg_flags & MSG_CTRUNC))
            spawn_one(sock, fds);
        else
            answer(sock, -1, EINVAL, 0, -1);
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
    }
}

#ifndef SIOCGSKNS
#define SIOCGSKNS 0x894C
#endif
#define NAMESPACES_MAX 64 /* made per request (agent/launching.py's NAMESPACES_MAX) */

static volatile pid_t family_init;

static void end_family(int signo) {
    (void)signo;
    kill(family_init, SIGKILL); /* the poll below sees it end, and reaps it */
}

/* Send "count" and the count fds (SCM_RIGHTS) over conn; -1 if it cannot. */
static int send_made(int conn, const int *made, int count) {
    char text[16];
    int len = snprintf(text, sizeof text, "%d", count);
    struct iovec iov = {text, (size_t)len};
    union {
        char buf[CMSG_SPACE(NAMESPACES_MAX * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (count > 0) {
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(count * sizeof(int));
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(count * sizeof(int));
        memcpy(CMSG_DATA(cmsg), made, count * sizeof(int));
    }
    return sendmsg(conn, &msg, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* A family's launcher, once it has forked the family's init (agent/launching.py's
 * _make_namespaces_until, without its Python heap): until the init ends, make network
 * namespaces on the daemon's request over conn (a count; the answer, as many as could be
 * made, as fds), each owned by the family's user namespace, coming back to home after
 * each; SIGTERM ends the family (kills its init, then reaps it). */
static int launcher(pid_t init, int conn, int home) {
    prctl(PR_SET_NAME, "bb-launcher");
    family_init = init;
    struct sigaction term = {.sa_handler = end_family};
    sigaction(SIGTERM, &term, NULL);
    int pidfd = (int)syscall(SYS_pidfd_open, init, 0);
    if (pidfd < 0)
        return 1;
    struct pollfd watch[2] = {{.fd = pidfd, .events = POLLIN}, {.fd = conn, .events = POLLIN}};
    nfds_t watched = 2;
    for (;;) {
        if (poll(watch, watched, -1) < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (watch[0].revents) {
            waitpid(init, NULL, 0);
            return 0;
        }
        if (watched < 2 || !watch[1].revents)
            continue;
        char text[16];
        ssize_t got = recv(conn, text, sizeof text - 1, 0);
        int count = -1;
        if (got > 0) {
            text[got] = '\0';
            char *end;
            long asked = strtol(text, &end, 10);
            if (end != text && asked >= 0)
                count = asked > NAMESPACES_MAX ? NAMESPACES_MAX : (int)asked;
        }
        if (count < 0) { /* the daemon hung up (or a daemon restarted: the next has none) */
            close(conn);
            watched = 1;
            continue;
        }
        int made[NAMESPACES_MAX];
        int n = 0;
        while (n < count && unshare(CLONE_NEWNET) == 0) {
            int probe = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
            int ns = probe < 0 ? -1 : ioctl(probe, SIOCGSKNS);
            if (probe >= 0)
                close(probe);
            if (ns < 0)
                break;
            made[n++] = ns;
        }
        if (setns(home, CLONE_NEWNET) != 0 || send_made(conn, made, n) != 0) {
            close(conn); /* it makes no more (the daemon plugs children after their hello) */
            watched = 1;
        }
        for (int i = 0; i < n; i++)
            close(made[i]);
    }
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--launcher") == 0) {
        int conn = atoi(argv[3]), home = atoi(argv[4]);
        /* stdio stays (the daemon's log of this sandbox); no other fd but these two */
        for (int fd = 3; fd < 1024; fd++)
            if (fd != conn && fd != home)
                close(fd);
        return launcher((pid_t)atoi(argv[2]), conn, home);
    }
    if (argc == 2 && strcmp(argv[1], "--reap") == 0) {
        /* A family's init (agent/launching.py) execs this once it has forked the first
         * REPL: its parent-death signal and its signal dispositions (all default) carry
         * over; its Python heap, ~2 MB of private pages per family, does not. */
        prctl(PR_SET_NAME, "bb-family");
        reap_forever();
    }
    if (argc < 4)
        return 2;
    ready_fd = atoi(argv[2]);
    int sock = atoi(argv[3]);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        return fail("prctl(PR_SET_PDEATHSIG)");
    for (int i = 4; i < argc; i++) {
        int fd = atoi(argv[i]);
        if (write(fd, "0", 1) != 1)
            return fail("joining the commands cgroup");
        close(fd);
    }
    if (unshare(CLONE_NEWPID) != 0)
        return fail("unshare(CLONE_NEWPID)");
    int status[2];
    if (pipe2(status, O_CLOEXEC) != 0)
        return fail("pipe");
    pid_t init = fork();
    if (init < 0)
        return fail("forking Q's init");
    if (init == 0) {
        close(status[0]);
        q_init(argv[1], status[1]);
    }
    close(status[1]);
    char why[512];
    ssize_t got = read(status[0], why, sizeof why - 1);
    close(status[0]);
    if (got != 1 || why[0] != '\0') {
        if (got <= 0)
            dprintf(ready_fd, "Q's init died before mounting /proc");
        else
            dprintf(ready_fd, "%.*s", (int)got, why);
        return 1;
    }
    if (write(ready_fd, "", 1) != 1)
        return 1;
    signal(SIGPIPE, SIG_IGN);
    /* Nothing of the REPL's: stdio on /dev/null (so received fds never land on 0-2),
     * every other fd but the socket closed. */
    int null = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3; fd++)
        dup2(null, fd);
    if (sock > 3)
        syscall(SYS_close_range, 3, sock - 1, 0);
    close_from(sock + 1);
    fcntl(sock, F_SETFD, FD_CLOEXEC);
    serve(sock);
}
