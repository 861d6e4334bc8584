"""Pod IPs: one local address per pod, from the test bed's pod CIDR."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import threading


class IpPool:
    """Pod IPs from a CIDR, handed out round-robin so a released address is reused as late as possible.

    With `device` set, each address is added to that interface (`lo`) while a pod holds it, so that a
    pod can bind it although it is no loopback address (EndpointSlices refuse 127.0.0.0/8).
    """

    def __init__(self, cidr: str, device: str | None = None) -> None:
        net = ipaddress.ip_network(cidr)
        self._hosts = [str(h) for h in net.hosts()]
        self._used: dict[str, str] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._device = device

    def allocate(self, uid: str, wanted: str | None = None) -> str:
        with self._lock:
            if uid in self._used:
                return self._used[uid]
            taken = set(self._used.values())
            if wanted in self._hosts and wanted not in taken:
                ip = wanted
            else:
                for k in range(len(self._hosts)):
                    ip = self._hosts[(self._next + k) % len(self._hosts)]
                    if ip not in taken:
                        self._next = (self._next + k + 1) % len(self._hosts)
                        break
                else:
                    raise RuntimeError(f"pod CIDR exhausted ({len(self._hosts)} addresses in use)")
            self._ip("add", ip)
            self._used[uid] = ip
            return ip

    def release(self, uid: str) -> None:
        with self._lock:
            ip = self._used.pop(uid, None)
            if ip is not None:
                self._ip("del", ip)

    def _ip(self, verb: str, ip: str) -> None:
        if self._device is None:
            return
        done = subprocess.run(
            ["ip", "addr", verb, f"{ip}/32", "dev", self._device], capture_output=True, text=True, check=False
        )
        # "File exists"/"Cannot assign": the address is already (or no longer) there, as wanted.
        if done.returncode != 0 and not re.search(r"File exists|Cannot assign", done.stderr):
            raise RuntimeError(f"ip addr {verb} {ip}/32 dev {self._device}: {done.stderr.strip()}")
