"""The system calls no action's program needs, refused by a seccomp filter.

Each action's process installs the filter (``program``) once the sandbox's own set-up is done
(namespaces, mounts, uid, limits) and before its program runs, so it holds for the program and for
everything that program executes; the fork server sets ``no_new_privs`` once for all of them, which
a filter needs. A denied call answers ``EPERM`` and the process carries on, as a program that probes
expects (a program killed for a probe would look like a crash of the program).

What is denied: loading and unloading kernel modules, ``kexec``, the kernel keyrings, ``bpf``,
``perf_event_open``, ``userfaultfd``, ``io_uring``, mounting and unmounting (the sandbox's own
mounts are made before the filter), new namespaces (``unshare``, ``setns``, ``clone`` with a
namespace flag; ``clone3``, whose flags a filter cannot read, answers ``ENOSYS``, upon which libc
falls back to ``clone``), ``clone`` with ``CLONE_PARENT`` and ``ptrace(PTRACE_TRACEME)`` (see
``CLONE_PARENT`` and ``PTRACE_TRACEME``), file handles (``open_by_handle_at`` opens any file of a
mount by its number), ``reboot``, swap, the clocks, the host and domain names, the kernel log, quotas, process
accounting, ``chroot``, ``vhangup``, and the calls of old kernels. Calls from another ABI than the
native one (i386's ``int 0x80``, x32) are all refused: their numbers differ, and nothing in the
sandbox images is built for them.

Only x86-64 has a table here; elsewhere no filter is installed and the agent says so.
"""

from __future__ import annotations

import os
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM = 1
ENOSYS = 38

# Namespace flags: refused in clone's flags, and in unshare's (CLONE_NEWTIME there too; in clone's
# flags 0x80 is part of the exit signal).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NEW_NAMESPACES = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
# A sibling of the caller: for an action, a child of the zygote inside the action's PID namespace.
# The zygote reaps only the children it made, and the kernel's teardown of the namespace (the init's
# exit) waits until every process of it is reaped, so such a sibling held its action's call past any
# timeout, with its slot, cores and uid. No libc, runtime or toolchain passes it (fork, vfork,
# posix_spawn and threads do not).
CLONE_PARENT = 0x00008000
# What clone's flags may not hold.
CLONE_REFUSED = NEW_NAMESPACES | CLONE_PARENT
# ptrace's request that makes the caller's parent its tracer: for an action's own process (any of
# its threads), the zygote. A traced thread that exits stays a zombie until its tracer reaps it,
# the zygote never does, and the action's process is not reapable while it stays: the call never
# answered, past any timeout, as with CLONE_PARENT. Only the request is refused (``PTRACE_ATTACH``,
# ``PTRACE_SEIZE`` and the rest stay: they make the caller a tracer, and the kernel lets it trace
# only processes of its own namespace). Compared by its low 32 bits: a request whose high ones are
# set is invalid anyway.
PTRACE_TRACEME = 0

# x86-64's numbers, by class (docs/reliability.md has a row per class; the tests try each).
DENIED_X86_64: dict[str, dict[str, int]] = {
    "kernel modules": {"init_module": 175, "finit_module": 313, "delete_module": 176},
    "kexec": {"kexec_load": 246, "kexec_file_load": 320},
    "keyrings": {"add_key": 248, "request_key": 249, "keyctl": 250},
    "bpf and perf": {"bpf": 321, "perf_event_open": 298},
    "kernel attack surface": {
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
    },
    "mounts": {
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "chroot": 161,
    },
    "namespaces": {"setns": 308},
    "file handles": {"name_to_handle_at": 303, "open_by_handle_at": 304},
    "the machine": {
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "settimeofday": 164,
        "clock_settime": 227,
        "clock_adjtime": 305,
        "adjtimex": 159,
        "sethostname": 170,
        "setdomainname": 171,
        "syslog": 103,
        "acct": 163,
        "quotactl": 179,
        "quotactl_fd": 443,
        "vhangup": 153,
        "iopl": 172,
        "ioperm": 173,
    },
    "old kernels' calls": {
        "uselib": 134,
        "_sysctl": 156,
        "create_module": 174,
        "get_kernel_syms": 177,
        "query_module": 178,
        "nfsservctl": 180,
        "lookup_dcookie": 212,
    },
}
CLONE_X86_64 = 56
PTRACE_X86_64 = 101
UNSHARE_X86_64 = 272
CLONE3_X86_64 = 435

# Classic BPF: the opcodes used below.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian here).
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


def supported() -> bool:
    """Whether this machine has a table here."""
    return os.uname().machine == "x86_64"


def program() -> bytes:
    """The filter as an array of ``struct sock_filter`` (what ``struct sock_fprog`` points at).

    The call number is looked up by a binary search over runs of consecutive numbers with the
    same answer (about a dozen comparisons, against some sixty for a chain; the mounts, the
    machine's calls and the old kernels' calls are mostly one run, 163 to 180). Every action's
    process installs the filter, and the kernel's work for that grows with its length: it checks
    and translates the program, compiles it to machine code, and runs it once for every call
    number to cache those it always allows.
    """
    if not supported():
        raise OSError(f"no seccomp table for {os.uname().machine}")
    special = {nr: "eperm" for calls in DENIED_X86_64.values() for nr in calls.values()}
    special |= {
        CLONE3_X86_64: "enosys",
        CLONE_X86_64: "clone",
        UNSHARE_X86_64: "unshare",
        PTRACE_X86_64: "ptrace",
    }
    # Instructions (code, k, jt, jf) whose jumps may name a label, resolved below.
    code: list[tuple[int, int, str | int, str | int]] = [
        (_LD_W_ABS, _ARCH, 0, 0),
        (_JEQ_K, AUDIT_ARCH_X86_64, 0, "eperm"),
        (_LD_W_ABS, _NR, 0, 0),
        (_JGE_K, X32_SYSCALL_BIT, "eperm", 0),
    ]
    labels: dict[str, int] = {}
    # (first, last, answer): consecutive call numbers with the same answer, in order.
    runs: list[tuple[int, int, str]] = []
    for nr in sorted(special):
        if runs and runs[-1][1] == nr - 1 and runs[-1][2] == special[nr]:
            runs[-1] = (runs[-1][0], nr, special[nr])
        else:
            runs.append((nr, nr, special[nr]))

    def search(part: list[tuple[int, int, str]]) -> None:
        # Every number here is at least part[0]'s first one (the jumps above say so).
        if len(part) <= 3:
            for first, last, answer in part:
                if first == last:
                    code.append((_JEQ_K, first, answer, 0))
                else:  # below first: on to the next run; from first on and not past last: the answer
                    code.extend([(_JGE_K, first, 0, 1), (_JGE_K, last + 1, 0, answer)])
            code.append((_RET_K, SECCOMP_RET_ALLOW, 0, 0))
            return
        mid = len(part) // 2
        upper = f"from {part[mid][0]}"
        code.append((_JGE_K, part[mid][0], upper, 0))
        search(part[:mid])
        labels[upper] = len(code)
        search(part[mid:])

    search(runs)
    labels["clone"] = len(code)
    code += [(_LD_W_ABS, _ARG0_LOW, 0, 0), (_JSET_K, CLONE_REFUSED, "eperm", "allow")]
    labels["unshare"] = len(code)
    code += [(_LD_W_ABS, _ARG0_LOW, 0, 0), (_JSET_K, NEW_NAMESPACES | CLONE_NEWTIME, "eperm", "allow")]
    labels["ptrace"] = len(code)
    code += [(_LD_W_ABS, _ARG0_LOW, 0, 0), (_JEQ_K, PTRACE_TRACEME, "eperm", "allow")]
    labels["allow"] = len(code)
    code.append((_RET_K, SECCOMP_RET_ALLOW, 0, 0))
    labels["eperm"] = len(code)
    code.append((_RET_K, SECCOMP_RET_ERRNO | EPERM, 0, 0))
    labels["enosys"] = len(code)
    code.append((_RET_K, SECCOMP_RET_ERRNO | ENOSYS, 0, 0))
    out = bytearray()
    for at, (op, k, jt, jf) in enumerate(code):

        def offset(target: str | int, at: int = at) -> int:
            if isinstance(target, int):
                return target
            jump = labels[target] - at - 1
            if not 0 <= jump <= 255:
                raise ValueError(f"seccomp filter: jump to {target} out of range")
            return jump

        out += struct.pack("<HBBI", op, offset(jt), offset(jf), k)
    return bytes(out)
