"""Where the workers are: static ``host:port`` entries, and DNS names that resolve to many addresses.

``dns:NAME:PORT`` is every address NAME resolves to, each at PORT: what a Kubernetes headless Service
gives (one A record per ready pod). The pool asks again every ``GatewayConfig.discovery_interval_s``;
a name that fails to resolve keeps its last answer (a DNS hiccup must not look like an empty fleet).

>>> parse_workers(("10.0.0.5:50051", "dns:workers.metronome.svc:50051"))
WorkerSources(static=('10.0.0.5:50051',), names=(('workers.metronome.svc', 50051),))
>>> parse_workers(("dns:workers",))
Traceback (most recent call last):
...
metronome.errors.ConfigError: a DNS worker entry is dns:NAME:PORT, got 'dns:workers'
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from metronome.errors import ConfigError

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:"

# name, port → the addresses (IPs) it resolves to now
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class WorkerSources:
    static: tuple[str, ...]
    names: tuple[tuple[str, int], ...]   # (DNS name, port)


def parse_workers(entries: tuple[str, ...]) -> WorkerSources:
    """Split ``GatewayConfig.workers`` into static addresses and DNS names; ConfigError for a bad entry."""
    static, names = [], []
    for entry in (e.strip() for e in entries):
        if entry.startswith(DNS_PREFIX):
            name, _, port = entry[len(DNS_PREFIX):].rpartition(":")
            if not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"a DNS worker entry is dns:NAME:PORT, got {entry!r}")
            names.append((name, int(port)))
        elif entry:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"a worker entry is host:port or dns:NAME:PORT, got {entry!r}")
            static.append(entry)
    return WorkerSources(tuple(static), tuple(names))


def address(ip: str, port: int) -> str:
    """host:port as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve_dns(name: str, port: int) -> list[str]:
    """The addresses ``name`` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


@dataclass
class Discovery:
    """The fleet's addresses now: the static ones plus what each name resolves to (its last good answer)."""

    sources: WorkerSources
    resolve: Resolver = resolve_dns
    _last: dict[tuple[str, int], set[str]] = field(default_factory=dict)

    @property
    def dynamic(self) -> bool:
        return bool(self.sources.names)

    async def addresses(self) -> list[str]:
        """In order: the static entries as given, then each name's addresses (sorted)."""
        found = dict.fromkeys(self.sources.static)
        for name, port in self.sources.names:
            try:
                ips = await self.resolve(name, port)
            except (OSError, ValueError) as exc:   # socket.gaierror is an OSError
                log.warning("resolving %s failed (%s); keeping its last %d addresses", name, exc,
                            len(self._last.get((name, port), ())))
            else:
                self._last[(name, port)] = {address(ip, port) for ip in ips}
            found.update(dict.fromkeys(sorted(self._last.get((name, port), ()))))
        return list(found)
