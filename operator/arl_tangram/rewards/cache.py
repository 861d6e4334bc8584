"""Which services' weights are on the GPU chunk: an LRU cache in bytes that never exceeds the device.

Pure bookkeeping (no I/O), used by the runtime before every batch: ``plan`` names the services to
evict, least recently used first, so that the next one fits; services marked ``keep`` (minimum
replicas resident) and the one running now are never chosen. ``pick_next`` is the resident
preference: among services with waiting requests, one already on the device goes first unless
another has waited past the grace period (so that no service starves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class DoesNotFit(Exception):
    """A service cannot be made resident: too big for the device, or everything else is pinned."""


@dataclass
class DeviceCache:
    """Bytes of device memory per service and which are resident, in LRU order."""

    capacity: int
    sizes: dict[str, int] = field(default_factory=dict)
    keep: set[str] = field(default_factory=set)
    _resident: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def add(self, service: str, nbytes: int, keep: bool = False) -> None:
        """Declare a service of ``nbytes`` on the device when resident."""
        if service in self.sizes:
            raise ValueError(f"service {service} declared twice")
        if nbytes <= 0:
            raise ValueError(f"service {service}: device bytes must be > 0")
        if nbytes > self.capacity:
            raise DoesNotFit(
                f"service {service} needs {nbytes / 2**30:.2f} GiB, more than the device's "
                f"{self.capacity / 2**30:.2f} GiB"
            )
        self.sizes[service] = nbytes
        if keep:
            kept = sum(self.sizes[s] for s in self.keep) + nbytes
            if kept > self.capacity:
                raise DoesNotFit(f"services kept resident need {kept / 2**30:.2f} GiB, more than the device")
            self.keep.add(service)

    @property
    def used(self) -> int:
        return sum(self.sizes[s] for s in self._resident)

    @property
    def resident(self) -> list[str]:
        """Resident services, least recently used first."""
        return list(self._resident)

    def is_resident(self, service: str) -> bool:
        return service in self._resident

    def plan(self, service: str, busy: Iterable[str] = ()) -> list[str]:
        """Services to evict (in order) before ``service`` fits; [] when it is resident or fits."""
        if service in self._resident:
            return []
        need = self.sizes[service]
        free = self.capacity - self.used
        protected = self.keep | set(busy)
        victims: list[str] = []
        for s in self._resident:
            if free >= need:
                break
            if s in protected:
                continue
            victims.append(s)
            free += self.sizes[s]
        if free < need:
            raise DoesNotFit(f"service {service} does not fit beside the services kept resident")
        return victims

    def mark_resident(self, service: str, recent: bool = True) -> None:
        """Record that ``service`` is now on the device (its victims must be evicted first), most
        recently used, or least when not ``recent`` (a pre-warm nobody asked for yet)."""
        if service in self._resident:
            self._resident.move_to_end(service, last=recent)
            return
        if self.used + self.sizes[service] > self.capacity:
            raise DoesNotFit(f"service {service} restored over the device's memory")
        self._resident[service] = None
        self._resident.move_to_end(service, last=recent)

    def mark_evicted(self, service: str) -> None:
        self._resident.pop(service, None)

    def touch(self, service: str) -> None:
        """The service ran: most recently used."""
        self._resident.move_to_end(service)


def pick_next(waiting: Mapping[str, float], cache: DeviceCache, now: float, grace_s: float) -> str | None:
    """The service to serve next from ``waiting`` (service -> arrival of its oldest request).

    The oldest request's service, unless a resident service has requests and that oldest request
    has waited less than ``grace_s``: then the resident service with the oldest request goes first
    (a restore costs more than the grace)."""
    if not waiting:
        return None
    oldest = min(waiting, key=lambda s: (waiting[s], s))
    if cache.is_resident(oldest) or now - waiting[oldest] >= grace_s:
        return oldest
    resident = [s for s in waiting if cache.is_resident(s)]
    if not resident:
        return oldest
    return min(resident, key=lambda s: (waiting[s], s))
