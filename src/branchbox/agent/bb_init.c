/*
 * bb-init: PID 1 of a sandbox's command PID namespace (Q).
 *
 * Started by the sandbox's REPL with posix_spawn (vfork + exec) right after it
 * unshared Q, instead of fork(): a fork would copy the page tables of the
 * whole REPL, which for a REPL holding a gigabyte of Python objects costs as
 * much as the fork of the REPL itself. Statically linked, so it runs on any
 * image.
 *
 *   bb-init PROC_DIR READY_FD [CGROUP_FD...]
 *
 * 1. dies with the REPL that started it (which tears down every command);
 * 2. joins the sandbox's commands cgroup (fds opened by the daemon);
 * 3. mounts /proc for Q at PROC_DIR: only a process inside Q can, because a
 *    proc mount shows the PID namespace of the process that mounts it;
 * 4. writes one NUL byte to READY_FD (or an error message), closes every fd;
 * 5. reaps orphans forever.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static int ready_fd = -1;

static int fail(const char *what) {
    dprintf(ready_fd, "%s: %s", what, strerror(errno));
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    ready_fd = atoi(argv[2]);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        return fail("prctl(PR_SET_PDEATHSIG)");
    for (int i = 3; i < argc; i++) {
        int fd = atoi(argv[i]);
        if (write(fd, "0", 1) != 1)
            return fail("joining the commands cgroup");
        close(fd);
    }
    if (mount("proc", argv[1], "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        return fail("mounting /proc");
    if (write(ready_fd, "", 1) != 1)
        return 1;
    for (int fd = 0; fd < 1024; fd++)
        close(fd);

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
