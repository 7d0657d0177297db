"""Worker discovery: static entries and DNS names, a failed lookup keeping the last answer."""

from __future__ import annotations

import socket

import pytest

from metronome.errors import ConfigError
from metronome.serving.gateway.discovery import Discovery, address, parse_workers, resolve_dns


def test_entries_split_into_static_addresses_and_names():
    sources = parse_workers(("a:1", " dns:w.svc:50051 ", "b:2", ""))
    assert sources.static == ("a:1", "b:2") and sources.names == (("w.svc", 50051),)


@pytest.mark.parametrize("entry", ["dns:w", "dns::50051", "dns:w:port", "dns:w:70000", "nohost", "h:p"])
def test_a_bad_entry_is_refused_with_what_it_should_be(entry):
    with pytest.raises(ConfigError, match="dns:NAME:PORT"):
        parse_workers((entry,))


def test_ipv6_addresses_are_bracketed_for_grpc():
    assert address("10.1.2.3", 50051) == "10.1.2.3:50051"
    assert address("fd00::7", 50051) == "[fd00::7]:50051"


async def test_names_resolve_to_every_address_and_a_failed_lookup_keeps_the_last_answer():
    answers = {"w.svc": ["10.0.0.2", "10.0.0.1"]}
    asked = []

    async def resolve(name: str, port: int) -> list[str]:
        asked.append((name, port))
        if name not in answers:
            raise socket.gaierror("no such name")
        return answers[name]

    discovery = Discovery(parse_workers(("s:9", "dns:w.svc:50051")), resolve)
    assert discovery.dynamic
    assert await discovery.addresses() == ["s:9", "10.0.0.1:50051", "10.0.0.2:50051"]
    answers["w.svc"] = ["10.0.0.3"]                # the fleet changed
    assert await discovery.addresses() == ["s:9", "10.0.0.3:50051"]
    del answers["w.svc"]                           # the resolver hiccups: the fleet is not empty for it
    assert await discovery.addresses() == ["s:9", "10.0.0.3:50051"]
    assert asked == [("w.svc", 50051)] * 3


async def test_the_system_resolver_answers_for_localhost():
    found = await resolve_dns("localhost", 50051)
    assert "127.0.0.1" in found or "::1" in found


async def test_a_static_fleet_is_not_dynamic():
    discovery = Discovery(parse_workers(("a:1", "b:2")))
    assert not discovery.dynamic and await discovery.addresses() == ["a:1", "b:2"]
