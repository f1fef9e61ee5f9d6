"""The syscall filter of sandboxes: Docker's default seccomp profile as data, and user profiles.

Owns:
- `ALLOWED` and `RULES`: the profile, written after the semantics of moby's
  profiles/seccomp/default.json (an allow-list, everything else EPERM; namespace flags of
  `clone` refused, `clone3` ENOSYS so that libc falls back to `clone`; `personality` only for
  the values programs use; `socket` of any family but AF_VSOCK; the calls Docker grants with a
  capability only when the sandbox has that capability, which for CAP_SYS_ADMIN (mount,
  umount, unshare, setns, bpf, ...) it never has);
- `Seccomp`: the profile a sandbox was made with, by name (`default`, `unconfined` or the
  path of a JSON file) and as the OCI `linux.seccomp` object runc applies;
- `resolve(spec, caps)`: `default`/None, `unconfined`, a path, or a profile dict, in Docker's
  format (`names`, `includes`/`excludes` caps and arches, `archMap`) or the OCI one.

Not in the list, so EPERM: keyctl, add_key, request_key (the kernel keyring is not
namespaced), mount and friends, unshare, setns, reboot, kexec, module loading, swapon, acct,
... (ptrace is allowed, as by Docker: the pid namespace bounds what it reaches).

Must not: start processes or write files; the launcher puts the result into config.json.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError

EPERM, ENOSYS = 1, 38
AF_VSOCK = 40
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: clone() with any of
# them is refused (a user namespace would make the sandbox root "root" again for mount).
CLONE_NAMESPACE_FLAGS = 0x7E020000
# personality(): PER_LINUX, PER_LINUX32, UNAME26 (and with PER_LINUX32), and the query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

ARCHES = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
}

# Allowed whatever the capabilities: file, memory, process, time, signal, socket and IPC calls
# (32-bit and time64 variants included: the filter also covers i386/x32 binaries).
_ALLOWED_NAMES = """
accept accept4 access adjtimex alarm bind brk cachestat capget capset chdir chmod chown chown32
clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64
clock_nanosleep clock_nanosleep_time64 close close_range connect copy_file_range creat dup dup2
dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait
epoll_wait_old eventfd eventfd2 execve execveat exit exit_group faccessat faccessat2 fadvise64
fadvise64_64 fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2 fchown fchown32 fchownat
fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstat64
fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex futex_requeue futex_time64
futex_wait futex_waitv futex_wake futimesat getcpu getcwd getdents getdents64 getegid getegid32
geteuid geteuid32 getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp
getpid getppid getpriority getrandom getresgid getresgid32 getresuid getresuid32 getrlimit
get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid gettimeofday
getuid getuid32 getxattr inotify_add_watch inotify_init inotify_init1 inotify_rm_watch
io_cancel ioctl io_destroy io_getevents io_pgetevents io_pgetevents_time64 ioprio_get
ioprio_set io_setup io_submit ipc kill landlock_add_rule landlock_create_ruleset
landlock_restrict_self lchown lchown32 lgetxattr link linkat listen listxattr llistxattr
_llseek lremovexattr lseek lsetxattr lstat lstat64 madvise map_shadow_stack membarrier
memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap mmap2
mprotect mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend
mq_timedsend_time64 mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock munlockall
munmap name_to_handle_at nanosleep newfstatat _newselect open openat openat2 pause pidfd_open
pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl
pread64 preadv preadv2 prlimit64 process_mrelease pselect6 pselect6_time64 pwrite64 pwritev
pwritev2 read readahead readlink readlinkat readv recv recvfrom recvmmsg recvmmsg_time64
recvmsg remap_file_pages removexattr rename renameat renameat2 restart_syscall rmdir rseq
rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend
rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity sched_getattr
sched_getparam sched_get_priority_max sched_get_priority_min sched_getscheduler
sched_rr_get_interval sched_rr_get_interval_time64 sched_setaffinity sched_setattr
sched_setparam sched_setscheduler sched_yield seccomp select semctl semget semop semtimedop
semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto setfsgid setfsgid32
setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid setpriority
setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid setreuid32 setrlimit
set_robust_list setsid setsockopt set_thread_area set_tid_address setuid setuid32 setxattr
shmat shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4 sigprocmask sigreturn
socketcall socketpair splice stat stat64 statfs statfs64 statx symlink symlinkat sync
sync_file_range syncfs sysinfo tee tgkill time timer_create timer_delete timer_getoverrun
timer_gettime timer_gettime64 timer_settime timer_settime64 timerfd_create timerfd_gettime
timerfd_gettime64 timerfd_settime timerfd_settime64 times tkill truncate truncate64 ugetrlimit
umask uname unlink unlinkat utime utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid
waitpid write writev
ptrace process_vm_readv process_vm_writev
"""  # ptrace and process_vm_*: allowed by Docker on kernels >= 4.8 (every one we run)
ALLOWED = tuple(_ALLOWED_NAMES.split())


def _allow(*names: str, **condition: Any) -> dict[str, Any]:
    return {"names": list(names), "action": "SCMP_ACT_ALLOW", **condition}


def _arg(index: int, value: int, op: str, value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


# Rules with arguments or conditions, in Docker's format: `includes`/`excludes` name the
# capabilities (and architectures) a rule applies with.
RULES: tuple[dict[str, Any], ...] = (
    *(_allow("personality", args=[_arg(0, value, "SCMP_CMP_EQ")]) for value in PERSONALITIES),
    _allow("socket", args=[_arg(0, AF_VSOCK, "SCMP_CMP_NE")]),
    _allow("arch_prctl", "modify_ldt", includes={"arches": ["amd64", "x32", "x86"]}),
    _allow("clone", args=[_arg(0, CLONE_NAMESPACE_FLAGS, "SCMP_CMP_MASKED_EQ")],
           excludes={"caps": ["CAP_SYS_ADMIN"]}),
    {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS,
     "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
    _allow("bpf", "clone", "clone3", "fanotify_init", "fsconfig", "fsmount", "fsopen", "fspick",
           "lookup_dcookie", "mount", "mount_setattr", "move_mount", "open_tree",
           "perf_event_open", "quotactl", "quotactl_fd", "setdomainname", "sethostname",
           "setns", "syslog", "umount", "umount2", "unshare",
           includes={"caps": ["CAP_SYS_ADMIN"]}),
    _allow("chroot", includes={"caps": ["CAP_SYS_CHROOT"]}),
    _allow("reboot", includes={"caps": ["CAP_SYS_BOOT"]}),
    _allow("delete_module", "init_module", "finit_module", includes={"caps": ["CAP_SYS_MODULE"]}),
    _allow("acct", includes={"caps": ["CAP_SYS_PACCT"]}),
    _allow("kcmp", "pidfd_getfd", "process_madvise", includes={"caps": ["CAP_SYS_PTRACE"]}),
    _allow("iopl", "ioperm", includes={"caps": ["CAP_SYS_RAWIO"]}),
    _allow("settimeofday", "stime", "clock_settime", "clock_settime64",
           includes={"caps": ["CAP_SYS_TIME"]}),
    _allow("vhangup", includes={"caps": ["CAP_SYS_TTY_CONFIG"]}),
    _allow("get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node",
           includes={"caps": ["CAP_SYS_NICE"]}),
    _allow("syslog", includes={"caps": ["CAP_SYSLOG"]}),
    _allow("bpf", includes={"caps": ["CAP_BPF"]}),
    _allow("perf_event_open", includes={"caps": ["CAP_PERFMON"]}),
)

DEFAULT_PROFILE: dict[str, Any] = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "defaultErrnoRet": EPERM,
    "syscalls": [_allow(*ALLOWED), *RULES],
}

_DOCKER_ARCH = {"x86_64": ("amd64", "x86", "x32"), "aarch64": ("arm64", "arm")}
_OCI_KEYS = ("index", "value", "valueTwo", "op")


@dataclass(frozen=True)
class Seccomp:
    """A sandbox's filter: `name` is `default`, `unconfined` or a profile file's path;
    `profile` the OCI `linux.seccomp` object (None when unconfined)."""

    name: str
    profile: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (kept in the sandbox's bundle)."""
        return {"name": self.name, "profile": self.profile}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Seccomp:
        """The inverse of `to_json`."""
        return cls(str(data["name"]), data.get("profile"))


def resolve(spec: str | Mapping[str, Any] | None, caps: Collection[str],
            machine: str | None = None) -> Seccomp:
    """The filter `spec` names, for a sandbox with capabilities `caps` (UsageError if the
    spec or the file is bad)."""
    machine = machine or platform.machine()
    if spec is None or spec == "default":
        return Seccomp("default", to_oci(DEFAULT_PROFILE, caps, machine))
    if isinstance(spec, Mapping):
        return Seccomp("custom", to_oci(spec, caps, machine))
    if spec == "unconfined":
        return Seccomp("unconfined", None)
    if not spec:
        raise UsageError("seccomp= needs `unconfined`, `default` or a profile's JSON file")
    path = Path(spec).absolute()
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise UsageError(f"cannot read seccomp profile {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"seccomp profile {path} is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise UsageError(f"seccomp profile {path} is not a JSON object")
    return Seccomp(str(path), to_oci(document, caps, machine, str(path)))


def to_oci(profile: Mapping[str, Any], caps: Collection[str], machine: str,
           what: str = "the seccomp profile") -> dict[str, Any]:
    """`profile` (Docker's or OCI's format) as OCI `linux.seccomp`: conditions resolved
    against `caps` and `machine`, one entry per rule."""
    action = profile.get("defaultAction")
    if not isinstance(action, str) or not action.startswith("SCMP_ACT_"):
        raise UsageError(f"{what} has no valid defaultAction")
    arches = _architectures(profile, machine)
    out: dict[str, Any] = {"defaultAction": action, "architectures": arches, "syscalls": []}
    if "defaultErrnoRet" in profile:
        out["defaultErrnoRet"] = int(profile["defaultErrnoRet"])
    syscalls = profile.get("syscalls") or []
    if not isinstance(syscalls, list):
        raise UsageError(f"{what}: syscalls must be a list")
    for rule in syscalls:
        converted = _rule(rule, caps, machine, what)
        if converted is not None:
            out["syscalls"].append(converted)
    return out


def _architectures(profile: Mapping[str, Any], machine: str) -> list[str]:
    if isinstance(profile.get("architectures"), list):
        return [str(a) for a in profile["architectures"]]
    for entry in profile.get("archMap") or []:  # Docker's: the native arch and its subs
        if isinstance(entry, dict) and entry.get("architecture") == ARCHES.get(machine, ("",))[0]:
            return [entry["architecture"], *entry.get("subArchitectures", [])]
    return list(ARCHES.get(machine, ()))


def _rule(rule: Any, caps: Collection[str], machine: str, what: str) -> dict[str, Any] | None:
    if not isinstance(rule, dict) or not isinstance(rule.get("action"), str):
        raise UsageError(f"{what}: every syscall rule needs an action")
    names = rule.get("names") or ([rule["name"]] if rule.get("name") else [])
    if not names or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{what}: every syscall rule needs names")
    if not _applies(rule.get("includes") or {}, rule.get("excludes") or {}, caps, machine):
        return None
    out: dict[str, Any] = {"names": list(names), "action": rule["action"]}
    if "errnoRet" in rule:
        out["errnoRet"] = int(rule["errnoRet"])
    args = rule.get("args") or []
    if args:
        try:
            out["args"] = [{k: a[k] for k in _OCI_KEYS if k in a} for a in args]
        except TypeError:
            raise UsageError(f"{what}: bad args of {names[0]}") from None
    return out


def _applies(includes: Mapping[str, Any], excludes: Mapping[str, Any], caps: Collection[str],
             machine: str) -> bool:
    """Docker's conditions: every included cap held and the arch listed; no excluded one."""
    arches = _DOCKER_ARCH.get(machine, ())
    if not set(includes.get("caps") or ()) <= set(caps):
        return False
    if includes.get("arches") and not set(includes["arches"]) & set(arches):
        return False
    if set(excludes.get("caps") or ()) & set(caps):
        return False
    return not (excludes.get("arches") and set(excludes["arches"]) & set(arches))
