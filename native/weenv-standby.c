/*
 * weenv-standby: the init of a sandbox made ahead of its run, waiting for its one command.
 *
 * A warm `weenv run` spent ~12 ms in the OCI runtime's one-shot `run` (namespaces, mounts,
 * cgroup, seccomp, then `catatonit -- COMMAND`), most of it the runtime's own start
 * (docs/design-notes.md). The node service therefore starts a parked root's next sandbox
 * after a run has answered its client (weenvfs/runtime/standby.py), with this program as
 * its pid 1 instead of catatonit; the next run of the same environment, user and limits
 * hands it its command and its standard streams over a Unix socket and waits for the status.
 *
 * Started by the runtime with fd 0 a listening Unix stream socket the host bound in the
 * sandbox's bundle (the runtime hands its own stdin to a detached init); stdout and stderr
 * are the sandbox's init log. It accepts one connection from uid 0, reads one request
 *
 *     "WSB1" u32 argc, u32 envc, u32 length (little endian), with SCM_RIGHTS: stdin,
 *     stdout, stderr; then `length` bytes: cwd, argv[0..argc), env[0..envc), each ending
 *     in a NUL
 *
 * and then does what `catatonit -- COMMAND` does: forks the command (its own process group,
 * the terminal's foreground group if stdin is one, every signal unblocked, the given streams,
 * folder and environment, looked up in that environment's PATH) once it said "started\n" on
 * the connection, forwards the signals it gets to it, reaps every orphan, and when the command
 * ends writes "exit N\n" on the connection (N its status, 128 + the signal if it was killed)
 * and exits with N (the kernel then kills whatever the command left in the sandbox). The
 * host closing the connection first (its run was killed) kills every process of the sandbox.
 * A bad request gets "error MESSAGE\n" and status 125 before anything started, and the host
 * then runs the command as without a standby (a receiver of another version refuses this
 * one's MAGIC). A command that cannot be run gets a line on its stderr and 127 (not found)
 * or 126, as from a shell.
 *
 * Statically linked: it runs in any image, as catatonit does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define MAGIC "WSB1"
#define MAX_REQUEST (64u << 20) /* far above ARG_MAX: a bound on what the host may send */
#define FIRST_SPARE_FD 10       /* the streams are moved here before they become 0, 1, 2 */

extern char **environ;

static int conn = -1;

/* Say `message` to the host (best effort: it may have gone) and to the init log; exit 125. */
static void refuse(const char *message) {
    char line[512];
    int n = snprintf(line, sizeof line, "error %s\n", message);
    if (conn >= 0 && n > 0)
        (void)!write(conn, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
    fprintf(stderr, "weenv-standby: %s\n", message);
    _exit(125);
}

static int read_full(int fd, char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = read(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The connection's request: fills `streams`, returns the strings (cwd, argv, env) split into
 * `words` (argc + envc + 1 of them, with room for NULLs after argv and env) or refuses. */
static char **read_request(int streams[3], uint32_t *argc, uint32_t *envc) {
    unsigned char head[16];
    char control[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {head, sizeof head};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    ssize_t got;
    do
        got = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof head || memcmp(head, MAGIC, 4) != 0)
        refuse("no request");
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (c == NULL || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
        c->cmsg_len != CMSG_LEN(3 * sizeof(int)) || (msg.msg_flags & MSG_CTRUNC))
        refuse("the request lacks its three streams");
    memcpy(streams, CMSG_DATA(c), 3 * sizeof(int));
    *argc = le32(head + 4);
    *envc = le32(head + 8);
    uint32_t length = le32(head + 12);
    if (*argc < 1 || length > MAX_REQUEST || *argc > length || *envc > length)
        refuse("a request out of bounds");
    char *text = malloc((size_t)length + 1);
    char **words = calloc((size_t)*argc + *envc + 3, sizeof(char *)); /* + argv's NULL */
    if (text == NULL || words == NULL)
        refuse("out of memory");
    if (read_full(conn, text, length) != 0)
        refuse("the request ended early");
    text[length] = '\0';
    uint32_t want = *argc + *envc + 1, found = 0;
    for (char *p = text; p < text + length; p += strlen(p) + 1) {
        if (found == want)
            refuse("a request with more strings than it says");
        words[found++] = p;
    }
    if (found != want || (length > 0 && text[length - 1] != '\0'))
        refuse("a request with fewer strings than it says");
    return words;
}

/* In the forked child: become the command, or say why not and exit 127 or 126. */
static void become(char **words, uint32_t argc, uint32_t envc, const int streams[3],
                   const sigset_t *old_mask) {
    char *cwd = words[0];
    char **argv = words + 1;
    char **env = words + 1 + argc + 1; /* argv's NULL slot is the one after argv */
    int moved[3];
    memmove(env, words + 1 + argc, envc * sizeof(char *));
    env[envc] = NULL;
    argv[argc] = NULL;
    for (int i = 0; i < 3; i++) /* out of 0..2 first: a received stream may sit there */
        moved[i] = fcntl(streams[i], F_DUPFD_CLOEXEC, FIRST_SPARE_FD);
    for (int i = 0; i < 3; i++)
        if (moved[i] < 0 || dup2(moved[i], i) < 0)
            _exit(125);
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    for (int s = 1; s < NSIG; s++)
        sigaction(s, &dfl, NULL);
    sigprocmask(SIG_SETMASK, old_mask, NULL);
    setpgid(0, 0);
    if (isatty(0)) {
        signal(SIGTTOU, SIG_IGN); /* tcsetpgrp from a background group stops us otherwise */
        tcsetpgrp(0, getpgrp());
        signal(SIGTTOU, SIG_DFL);
    }
    if (chdir(cwd) != 0) {
        dprintf(2, "weenv: cannot enter the working directory %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = env;
    execvp(argv[0], argv);
    int error = errno;
    dprintf(2, "weenv: %s: %s\n", argv[0], strerror(error));
    _exit(error == ENOENT || error == ENOTDIR ? 127 : 126);
}

int main(void) {
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    int signals = signalfd(-1, &all, SFD_CLOEXEC);
    if (signals < 0)
        refuse("signalfd failed");
    int listening = 0;
    int accepting = 0;
    socklen_t size = sizeof accepting;
    if (getsockopt(listening, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &size) != 0 || !accepting)
        refuse("stdin is not a listening socket");

    /* Wait for the run; a signal meant for the sandbox before it ends the standby. */
    struct pollfd wait_for[2] = {{listening, POLLIN, 0}, {signals, POLLIN, 0}};
    for (;;) {
        if (poll(wait_for, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            refuse("poll failed");
        }
        if (wait_for[1].revents) {
            struct signalfd_siginfo info;
            if (read(signals, &info, sizeof info) == sizeof info && info.ssi_signo != SIGCHLD)
                _exit(128 + (int)info.ssi_signo);
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
        }
        if (wait_for[0].revents) {
            conn = accept4(listening, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0)
                break;
            if (errno != EINTR && errno != ECONNABORTED)
                refuse("accept failed");
        }
    }
    close(listening);
    struct ucred peer;
    size = sizeof peer;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0 || peer.uid != 0)
        refuse("the request is not from root");

    int streams[3];
    uint32_t argc, envc;
    char **words = read_request(streams, &argc, &envc);
    /* Said before the fork: up to here the host may run the command another way (it falls
     * back on anything else), from here on it is this sandbox's, and runs at most once. */
    static const char started[] = "started\n";
    if (write(conn, started, sizeof started - 1) != (ssize_t)(sizeof started - 1))
        refuse("the host went away");
    pid_t child = fork();
    if (child < 0) {
        dprintf(streams[2], "weenv: cannot start %s: %s\n", words[1], strerror(errno));
        (void)!write(conn, "exit 125\n", 9);
        _exit(125);
    }
    if (child == 0)
        become(words, argc, envc, streams, &old);
    for (int i = 0; i < 3; i++)
        close(streams[i]);

    struct pollfd watch[2] = {{signals, POLLIN, 0}, {conn, POLLIN | POLLRDHUP, 0}};
    for (;;) {
        if (poll(watch, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            refuse("poll failed");
        }
        if (watch[1].revents) { /* the host wrote nothing more: its end closed */
            kill(-1, SIGKILL);
            _exit(137);
        }
        struct signalfd_siginfo info;
        if (read(signals, &info, sizeof info) != sizeof info)
            continue;
        if (info.ssi_signo != SIGCHLD) {
            kill(child, (int)info.ssi_signo);
            continue;
        }
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (pid != child)
                continue;
            int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            char line[32];
            int n = snprintf(line, sizeof line, "exit %d\n", code);
            (void)!write(conn, line, (size_t)n);
            _exit(code);
        }
    }
}
