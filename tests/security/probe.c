/* A static probe run inside sandboxes by tests/security: one syscall per verb, the result
 * printed as "ok" or the errno name, so a test compares words, not numbers.
 *   probe add_key | keyctl | personality | vsock | unshare_user | clone_ns | nnp */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/personality.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static int report(long rc) {
    if (rc < 0) {
        printf("%s\n", strerrorname_np(errno));
        return 1;
    }
    printf("ok\n");
    return 0;
}

int main(int argc, char **argv) {
    const char *verb = argc > 1 ? argv[1] : "";
    if (!strcmp(verb, "add_key"))
        return report(syscall(SYS_add_key, "user", "weenv-probe", "x", 1, -3 /* session */));
    if (!strcmp(verb, "keyctl"))  /* KEYCTL_GET_KEYRING_ID of the session keyring */
        return report(syscall(SYS_keyctl, 0, -3, 0));
    if (!strcmp(verb, "personality")) {
        long rc = personality(ADDR_NO_RANDOMIZE);
        return report(rc == -1 ? -1 : 0);
    }
    if (!strcmp(verb, "vsock"))
        return report(socket(40 /* AF_VSOCK */, SOCK_STREAM, 0));
    if (!strcmp(verb, "unshare_user"))
        return report(unshare(CLONE_NEWUSER));
    if (!strcmp(verb, "clone_ns")) {
        long rc = syscall(SYS_clone, CLONE_NEWNS | 17 /* SIGCHLD */, 0, 0, 0, 0);
        if (rc == 0)
            _exit(0);  /* the child */
        return report(rc);
    }
    fprintf(stderr, "probe: unknown verb %s\n", verb);
    return 2;
}
