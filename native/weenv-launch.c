/*
 * weenv-launch: the `weenv` command of a scripts/setup.sh install (.venv/bin/weenv).
 *
 * A warm `weenv run` (and `weenv pull`) is carried out by the node service
 * (weenvfs/hand_over.py, entry.HAND_OVER): the process
 * the user started only hands its arguments, environment and stdio over, then relays
 * signals and waits for the exit status. In Python that stand-in cost ~35 ms before its
 * request went out (the interpreter, site and the editable install's import finder: ~25
 * ms; the hand-over's own imports and work: ~10 ms), a third of a warm `weenv run` of
 * `true` (docs/benchmarks.md, "weenv run's fixed cost"). This program is that stand-in in
 * C: the same request (weenvfs/fuse/node_socket.py `request_line`, byte for byte: a test
 * compares them), the same descriptors, the same signal relay and exit status
 * (hand_over.py `_wait`). Everything else it hands to Python at once, by exec, with its
 * arguments unchanged: every other command, `-h`/`--help`, a user other than root, the
 * switches off (WEENV_NODE_RUN, WEENV_MOUNTD), no service listening (Python starts one),
 * and a service that did not take the request (stale code, another namespace: Python then
 * decides, as it would have). So it never decides anything Python would decide differently.
 *
 * Built by scripts/setup.sh with the venv's interpreter and the code folders baked in:
 *   -DWEENV_PYTHON='"/path/.venv/bin/python"'   (sys.executable of the service it talks to)
 *   -DWEENV_PACKAGE='"/path/weenvfs"'            (node_socket.PACKAGE)
 *   -DWEENV_CODE_DIRS='"/path/weenvfs:/path/format:/path/tools"'  (node_socket._code_folders)
 * which make the request's code fingerprint; a service whose code differs says so and the
 * run goes to Python.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#if !defined(WEENV_PYTHON) || !defined(WEENV_PACKAGE) || !defined(WEENV_CODE_DIRS)
#error "build with -DWEENV_PYTHON, -DWEENV_PACKAGE and -DWEENV_CODE_DIRS (scripts/setup.sh)"
#endif

#define EXIT_LOST 125 /* hand_over.EXIT_LOST */
#define CONNECT_TIMEOUT_S 5 /* node_socket.CONNECT_TIMEOUT */
#define SUN_PATH_MAX 107

extern char **environ;

/* --- a growing byte buffer ---------------------------------------------------------------- */

struct buf {
    char *data;
    size_t len, cap;
};

static void put(struct buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap)
            cap *= 2;
        char *grown = realloc(b->data, cap);
        if (grown == NULL)
            abort();
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

static void put_u16(struct buf *b, unsigned code) {
    char esc[8];
    snprintf(esc, sizeof esc, "\\u%04x", code);
    put(b, esc, 6);
}

/* The length of the valid UTF-8 sequence at s (n bytes left), or 0 when the byte at s does
 * not start one (Python's strict decoder: no overlongs, no surrogates, at most U+10FFFF). */
static size_t utf8_len(const unsigned char *s, size_t n, unsigned *code) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) {
        *code = c;
        return 1;
    } else if (c >= 0xc2 && c <= 0xdf) {
        len = 2, min = 0x80, *code = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3, min = 0x800, *code = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4, min = 0x10000, *code = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        *code = (*code << 6) | (s[i] & 0x3f);
    }
    if (*code < min || *code > 0x10ffff || (*code >= 0xd800 && *code <= 0xdfff))
        return 0;
    return len;
}

/* json.dumps' two-character escape of `code`, or NULL when it has none. */
static const char *short_escape(unsigned code) {
    switch (code) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\b': return "\\b";
    case '\f': return "\\f";
    default: return NULL;
    }
}

/* A JSON string as json.dumps writes the str Python makes of these bytes (the file system
 * encoding, UTF-8 with surrogateescape): printable ASCII as is, the rest escaped. */
static void put_quoted(struct buf *b, const char *text) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text);
    put(b, "\"", 1);
    while (n > 0) {
        unsigned code;
        size_t len = utf8_len(s, n, &code);
        const char *escape = len ? short_escape(code) : NULL;
        if (len == 0) { /* surrogateescape: the byte as U+DC80..U+DCFF */
            put_u16(b, 0xdc00 | s[0]);
            len = 1;
        } else if (escape) {
            put(b, escape, 2);
        } else if (code >= 0x20 && code < 0x7f) {
            char c = (char)code;
            put(b, &c, 1);
        } else if (code > 0xffff) {
            code -= 0x10000;
            put_u16(b, 0xd800 | (code >> 10));
            put_u16(b, 0xdc00 | (code & 0x3ff));
        } else {
            put_u16(b, code);
        }
        s += len;
        n -= len;
    }
    put(b, "\"", 1);
}

/* --- the request (node_socket.request_line) ----------------------------------------------- */

/* The newest modification time (ns) of a .py file below `folder` (node_socket._newest). */
static long long newest_py(int parent, const char *name) {
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return 0;
    }
    long long newest = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        const char *n = entry->d_name;
        size_t len = strlen(n);
        struct stat st;
        if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0)
            continue;
        if (len > 3 && strcmp(n + len - 3, ".py") == 0) {
            if (fstatat(fd, n, &st, 0) == 0 && S_ISREG(st.st_mode)) {
                long long ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
                if (ns > newest)
                    newest = ns;
                continue;
            }
        }
        if (strcmp(n, "__pycache__") != 0 && fstatat(fd, n, &st, AT_SYMLINK_NOFOLLOW) == 0
            && S_ISDIR(st.st_mode)) {
            long long below = newest_py(fd, n);
            if (below > newest)
                newest = below;
        }
    }
    closedir(dir);
    return newest;
}

static void put_fingerprint(struct buf *b) {
    char dirs[] = WEENV_CODE_DIRS, *save = NULL;
    long long newest = 0;
    for (char *dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        long long n = newest_py(AT_FDCWD, dir);
        if (n > newest)
            newest = n;
    }
    struct buf print = {0};
    char number[32];
    snprintf(number, sizeof number, "%lld", newest);
    puts_(&print, WEENV_PYTHON "|" WEENV_PACKAGE "|");
    puts_(&print, number);
    put_quoted(b, print.data);
    free(print.data);
}

static unsigned read_umask(void) {
    FILE *status = fopen("/proc/self/status", "re");
    unsigned mask = 022;
    char line[256];
    if (status == NULL)
        return mask;
    while (fgets(line, sizeof line, status))
        if (strncmp(line, "Umask:", 6) == 0) {
            mask = (unsigned)strtoul(line + 6, NULL, 8);
            break;
        }
    fclose(status);
    return mask;
}

static void put_namespaces(struct buf *b) {
    static const char *kinds[] = {"mnt", "net"};
    int first = 1;
    put(b, "{", 1);
    for (int i = 0; i < 2; i++) {
        char path[64], target[PATH_MAX];
        snprintf(path, sizeof path, "/proc/self/ns/%s", kinds[i]);
        ssize_t n = readlink(path, target, sizeof target - 1);
        if (n < 0)
            continue;
        target[n] = '\0';
        if (!first)
            puts_(b, ", ");
        first = 0;
        put_quoted(b, kinds[i]);
        puts_(b, ": ");
        put_quoted(b, target);
    }
    put(b, "}", 1);
}

/* The request line of `weenv ARGS` (for `run`, ARGS with `--owner-pid PID` after the command
 * word: hand_over.delegate; a pull leaves no sandbox to own). */
static void build_request(struct buf *b, char **args, int count, int at, const char *cwd) {
    int owned = strcmp(args[at], "run") == 0;
    char pid[32], number[32];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    puts_(b, "{\"argv\": [");
    for (int i = 0; i < count; i++) {
        if (i > 0)
            puts_(b, ", ");
        put_quoted(b, args[i]);
        if (i == at && owned) {
            puts_(b, ", ");
            put_quoted(b, "--owner-pid");
            puts_(b, ", ");
            put_quoted(b, pid);
        }
    }
    puts_(b, "], \"env\": {");
    int first = 1;
    for (char **e = environ; *e; e++) {
        char *eq = strchr(*e, '=');
        if (eq == NULL || eq == *e)
            continue;
        if (!first)
            puts_(b, ", ");
        first = 0;
        *eq = '\0';
        put_quoted(b, *e);
        *eq = '=';
        puts_(b, ": ");
        put_quoted(b, eq + 1);
    }
    snprintf(number, sizeof number, "%u", read_umask());
    puts_(b, "}, \"umask\": ");
    puts_(b, number);
    puts_(b, ", \"fingerprint\": ");
    put_fingerprint(b);
    puts_(b, ", \"namespaces\": ");
    put_namespaces(b);
    puts_(b, ", \"kind\": \"attached\", \"cwd\": ");
    put_quoted(b, cwd);
    puts_(b, "}\n");
}

/* --- asking the service (node_socket.ask) ------------------------------------------------- */

static const char *socket_path(void) {
    const char *path = getenv("WEENV_MOUNTD_SOCKET");
    return path && *path ? path : "/run/weenv/mountd.sock"; /* run_base() of root */
}

/* The service's answer once the request went out (node_socket.ask and read_line): 1 for
 * `ok`, or when the answer is lost (it may have started the command: the pipes tell), 0 for
 * anything else, or none at all before the service closed. */
static int read_answer(int conn) {
    char answer[4096];
    size_t have = 0;
    while (have < sizeof answer - 1 && !memchr(answer, '\n', have)) {
        ssize_t got = recv(conn, answer + have, sizeof answer - 1 - have, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return 1;
        if (got == 0)
            break;
        have += (size_t)got;
    }
    answer[have] = '\0';
    char *line = answer, *end = strchr(answer, '\n');
    if (end)
        *end = '\0';
    while (*line == ' ' || *line == '\t' || *line == '\r' || *line == '\v' || *line == '\f')
        line++;
    size_t len = strlen(line);
    while (len > 0 && strchr(" \t\r\v\f", line[len - 1]))
        line[--len] = '\0';
    return strcmp(line, "ok") == 0;
}

/* Sends the request with `fds`: 1 if the service took it, 0 if it declined or none listens
 * (then nothing was started). */
static int ask(const struct buf *request, const int *fds, int nfds) {
    const char *path = socket_path();
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    int folder = -1, conn = -1, taken = 0;
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    if (strlen(path) <= SUN_PATH_MAX) {
        strcpy(address.sun_path, path);
    } else { /* node_socket.addressable: the folder opened with O_PATH */
        char copy[PATH_MAX];
        snprintf(copy, sizeof copy, "%s", path);
        char *slash = strrchr(copy, '/');
        if (slash == NULL)
            return 0;
        *slash = '\0';
        folder = open(*copy ? copy : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (folder < 0)
            return 0;
        snprintf(address.sun_path, sizeof address.sun_path, "/proc/self/fd/%d/%s", folder,
                 slash + 1);
    }
    conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (conn >= 0) {
        struct timeval timeout = {.tv_sec = CONNECT_TIMEOUT_S};
        setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
        setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    }
    if (conn >= 0 && connect(conn, (struct sockaddr *)&address, sizeof address) == 0) {
        char control[CMSG_SPACE(8 * sizeof(int))] = {0};
        struct iovec iov = {.iov_base = request->data, .iov_len = request->len};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = CMSG_SPACE(nfds * sizeof(int))};
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(cmsg), fds, nfds * sizeof(int));
        if (sendmsg(conn, &msg, MSG_NOSIGNAL) >= 0)
            taken = read_answer(conn);
    }
    if (conn >= 0)
        close(conn);
    if (folder >= 0)
        close(folder);
    return taken;
}

/* --- waiting for the command (hand_over._wait) --------------------------------------------- */

static volatile sig_atomic_t command_pid;
static volatile sig_atomic_t received[NSIG];
static volatile sig_atomic_t last_fatal;

static void relay(int signum) {
    received[signum] = 1;
    if (signum != SIGINT)
        last_fatal = signum;
    if (command_pid > 0)
        kill((pid_t)command_pid, signum);
}

static int wait_status(int status_read) {
    char data[8192];
    size_t have = 0;
    for (;;) {
        ssize_t got = read(status_read, data + have, sizeof data - 1 - have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        have += (size_t)got;
        data[have] = '\0';
        char *line = data, *end;
        while ((end = strchr(line, '\n')) != NULL) {
            *end = '\0';
            if (strncmp(line, "pid ", 4) == 0 && command_pid == 0) {
                command_pid = (sig_atomic_t)atoi(line + 4);
                for (int s = 1; s < NSIG; s++)
                    if (received[s])
                        kill((pid_t)command_pid, s);
            } else if (strncmp(line, "exit ", 5) == 0) {
                return atoi(line + 5);
            }
            line = end + 1;
        }
        have = strlen(line);
        memmove(data, line, have + 1);
        if (have >= sizeof data - 1)
            have = 0; /* a line that long is no status line */
    }
    if (last_fatal) { /* the command died of a relayed SIGTERM or SIGHUP: so does this */
        int signum = last_fatal;
        signal(signum, SIG_DFL);
        kill(getpid(), signum);
        return 128 + signum;
    }
    fputs("weenv: error: the node service's run of this command ended without an exit "
          "status (see `weenv mountd --check` and its log)\n", stderr);
    return EXIT_LOST;
}

/* --- deciding (entry.main, hand_over.wanted) ----------------------------------------------- */

static void python(char **argv) {
    int count = 0;
    while (argv[count])
        count++;
    char **args = calloc((size_t)count + 4, sizeof *args);
    if (args == NULL)
        abort();
    args[0] = WEENV_PYTHON;
    args[1] = "-P"; /* as the console script: nothing of the working folder on sys.path */
    args[2] = "-m";
    args[3] = "weenvfs";
    for (int i = 1; i < count; i++)
        args[i + 3] = argv[i];
    execv(WEENV_PYTHON, args);
    fprintf(stderr, "weenv: error: cannot run %s: %s\n", WEENV_PYTHON, strerror(errno));
    exit(127);
}

/* command_word.command_at: where the command word is, or -1. */
static int command_at(char **words, int count) {
    for (int at = 0; at < count; at++) {
        if (strcmp(words[at], "--version") == 0)
            return at;
        if (strcmp(words[at], "--log-file") == 0) {
            at++;
            continue;
        }
        if (strcmp(words[at], "--") == 0)
            return -1;
        if (words[at][0] != '-')
            return at;
    }
    return -1;
}

/* Whether switch `name` is anything but plainly on (weenvfs/switches.py): off, or a value
 * neither on nor off, which Python reports. Spaces around the word are ignored. */
static int not_on(const char *name) {
    static const char *on[] = {"", "on", "1", "yes", "true"};
    const char *value = getenv(name);
    if (value == NULL)
        return 0;
    while (*value == ' ' || *value == '\t' || *value == '\n')
        value++;
    size_t len = strlen(value);
    while (len > 0 && (value[len - 1] == ' ' || value[len - 1] == '\t' || value[len - 1] == '\n'))
        len--;
    for (size_t i = 0; i < sizeof on / sizeof on[0]; i++)
        if (strlen(on[i]) == len && strncasecmp(value, on[i], len) == 0)
            return 0;
    return 1;
}

int main(int argc, char **argv) {
    char **words = argv + 1;
    int count = argc - 1;
    int at = command_at(words, count);
    if (at < 0 || (strcmp(words[at], "run") != 0 && strcmp(words[at], "pull") != 0)
        || geteuid() != 0
        || not_on("WEENV_NODE_RUN") || not_on("WEENV_MOUNTD"))
        python(argv);
    for (int i = 0; i < count; i++)
        if (strcmp(words[i], "-h") == 0 || strcmp(words[i], "--help") == 0)
            python(argv);
    char *cwd = getcwd(NULL, 0);
    if (cwd == NULL)
        python(argv);
    /* hand_over.open_standard_fds: a closed stdin, stdout or stderr becomes /dev/null, else
     * the pipes below would take its number and be passed on as the command's stdio. */
    for (int fd = 0; fd <= 2; fd++) {
        struct stat st;
        if (fstat(fd, &st) != 0 && errno == EBADF) {
            int opened = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
            if (opened >= 0 && opened != fd) {
                dup2(opened, fd);
                close(opened);
            }
        }
    }

    struct sigaction action = {.sa_handler = relay};
    sigemptyset(&action.sa_mask);
    int forwarded[] = {SIGINT, SIGTERM, SIGHUP};
    struct sigaction old[3];
    for (int i = 0; i < 3; i++)
        sigaction(forwarded[i], &action, &old[i]);

    int status[2], alive[2];
    if (pipe2(status, O_CLOEXEC) != 0 || pipe2(alive, O_CLOEXEC) != 0) {
        fprintf(stderr, "weenv: error: cannot hand the command to the node service: %s\n",
                strerror(errno));
        return 1;
    }
    struct buf request = {0};
    build_request(&request, words, count, at, cwd);
    int fds[5] = {0, 1, 2, status[1], alive[0]};
    int taken = ask(&request, fds, 5);
    close(status[1]);
    close(alive[0]);
    free(request.data);
    if (!taken) {
        close(status[0]);
        close(alive[1]);
        for (int i = 0; i < 3; i++)
            sigaction(forwarded[i], &old[i], NULL);
        if (received[SIGINT]) { /* interrupted before anything started (entry.main) */
            fputs("weenv: interrupted\n", stderr);
            return 130;
        }
        if (last_fatal) {
            signal(last_fatal, SIG_DFL);
            kill(getpid(), last_fatal);
        }
        python(argv);
    }
    int code = wait_status(status[0]);
    close(status[0]);
    close(alive[1]); /* the command's watch ends here: it has exited, or must */
    return code;
}
