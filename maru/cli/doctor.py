"""`maru doctor`: would an instance share the KV a store holds, and if not, which field
keeps it apart ("why no hit?").

From maru's configuration alone it knows the tenant (`namespace`) and `chunk_tokens`.
Given the instance's vLLM command line (read by vLLM's own parser, so `--config
vllm.yaml` works too) it works out the rest of the namespace record as the engine
would: model identity, dtypes, block size, TP size, hash algorithm and seed, and
maru's configuration from `--kv-transfer-config`. The layout fingerprint exists only
once an engine has allocated its KV cache, so it is shown, not compared.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from maru.cli.command import EXIT_FAILURE, EXIT_OK, Result, add_config_option, open_existing
from maru.config import MaruConfig, load_config
from maru.vllm.records import Namespace, differing_fields, last_active, namespaces

FROM_VLLM = (
    "model",
    "dtype",
    "kv_dtype",
    "block_size",
    "tp_size",
    "hash_algorithm",
    "hash_seed",
    "hash_seed_shared",
)
"""Record fields only the vLLM configuration decides."""
FROM_KV_CACHE = dict.fromkeys(
    ("layout", "kv_groups"), "known once an engine has allocated its KV cache"
)
"""What only an engine's KV cache tells: its layout and its KV cache groups."""


@dataclass
class Expectation:
    """What an instance's namespace record will say, as far as it is known here."""

    config: MaruConfig
    record: dict[str, Any]
    not_compared: dict[str, str]
    """Record fields not known here, and why."""
    advice: str | None = None
    """What makes block hashes match across processes, if they cannot here."""


@dataclass
class Diagnosis:
    """The expectation against every namespace in the store."""

    expectation: Expectation
    peers: list[tuple[Namespace, dict[str, tuple]]] = field(default_factory=list)
    """Each namespace with a record, and the known fields that differ (none: shares)."""
    unrecorded: list[Namespace] = field(default_factory=list)

    @property
    def shares_with(self) -> list[Namespace]:
        return [namespace for namespace, differs in self.peers if not differs]


def expect(config_file: str | None, vllm_command: list[str]) -> Expectation:
    """The record an instance with this maru config (and vLLM command line) will write."""
    if not vllm_command:
        config = load_config(config_file)
        unknown = dict.fromkeys(FROM_VLLM, "needs the vLLM command line, after --")
        return Expectation(config, _maru_fields(config), unknown | FROM_KV_CACHE)
    from maru.vllm.command_line import expected_record, vllm_config_from_command

    vllm_config = vllm_config_from_command(vllm_command)
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {}) if transfer else {}
    config = load_config(config_file, extra_config=extra)
    record, advice = expected_record(vllm_config, config)
    for name in FROM_KV_CACHE:
        del record[name]
    return Expectation(config, record, FROM_KV_CACHE, advice)


def _maru_fields(config: MaruConfig) -> dict[str, Any]:
    return {"namespace": config.namespace, "chunk_tokens": config.chunk_tokens}


def diagnose(store: Any, expectation: Expectation) -> Diagnosis:
    """Compare the expected record, field by known field, with each namespace's record."""
    diagnosis = Diagnosis(expectation)
    ours = expectation.record
    for namespace in namespaces(store):
        if not namespace.record:
            diagnosis.unrecorded.append(namespace)
            continue
        theirs = {name: namespace.record.get(name) for name in ours}
        diagnosis.peers.append((namespace, differing_fields(ours, theirs)))
    return diagnosis


def report(diagnosis: Diagnosis) -> dict[str, Any]:
    """The diagnosis as JSON-ready data."""
    expectation = diagnosis.expectation
    return {
        "instance": expectation.record,
        "not_compared": expectation.not_compared,
        "hash_seed_advice": expectation.advice,
        "namespaces": [
            {
                "name": ns.name,
                "objects": ns.objects,
                "active": ns.record.get("active"),
                "layout": ns.record.get("layout"),
                "shares": not differs,
                "differs": {
                    name: {"here": ours, "there": theirs}
                    for name, (ours, theirs) in differs.items()
                },
            }
            for ns, differs in diagnosis.peers
        ],
        "without_record": [ns.name for ns in diagnosis.unrecorded],
        "shares_with": [ns.name for ns in diagnosis.shares_with],
    }


def format_diagnosis(diagnosis: Diagnosis) -> str:
    """The diagnosis for people: this instance, each namespace, and the verdict."""
    expectation = diagnosis.expectation
    lines = [
        "this instance: "
        + ", ".join(f"{name} {value}" for name, value in sorted(expectation.record.items()))
    ]
    reasons: dict[str, list[str]] = {}
    for name, why in sorted(expectation.not_compared.items()):
        reasons.setdefault(why, []).append(name)
    lines.extend(f"not compared ({why}): {', '.join(names)}" for why, names in reasons.items())
    if expectation.advice:
        lines.append(f"block hashes differ in every process here: {expectation.advice}")
    for namespace, differs in diagnosis.peers:
        head = (
            f"{namespace.name}: {namespace.objects} objects, last active "
            f"{last_active(namespace.record)}"
        )
        if differs:
            lines.append(
                f"{head}: would not share: "
                + "; ".join(
                    f"{name} is {ours!r} here, {theirs!r} there"
                    for name, (ours, theirs) in differs.items()
                )
            )
        else:
            lines.append(f"{head}: would share (layout there: {namespace.record.get('layout')})")
    lines.extend(
        f"{ns.name}: {ns.objects} objects, no record (written by a maru that keeps "
        "none): cannot say"
        for ns in diagnosis.unrecorded
    )
    lines.append(_verdict(diagnosis))
    return "\n".join(lines)


def _verdict(diagnosis: Diagnosis) -> str:
    sharing = diagnosis.shares_with
    if sharing:
        return "=> would share with " + ", ".join(
            f"{ns.name} ({ns.objects} objects)" for ns in sharing
        )
    if not diagnosis.peers:
        return "=> the store holds no namespace records yet: nothing to share with"
    return f"=> would share with none of the {len(diagnosis.peers)} namespaces in the store"


def cmd_doctor(args: argparse.Namespace) -> Result:
    """Would an instance with this config (and vLLM command line) share what the store
    holds? Exit 1 if the store holds namespaces and it would share with none."""
    command = args.vllm_command[1:] if args.vllm_command[:1] == ["--"] else args.vllm_command
    expectation = expect(args.config, command)
    with open_existing(expectation.config) as store:
        diagnosis = diagnose(store, expectation)
    shares = bool(diagnosis.shares_with) or not diagnosis.peers
    return Result(
        report(diagnosis), format_diagnosis(diagnosis), EXIT_OK if shares else EXIT_FAILURE
    )


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """`maru doctor [--config F] [-- vllm serve MODEL ...]`."""
    doctor = commands.add_parser(
        "doctor",
        parents=[common],
        help="would an instance share what the store holds?",
        description="Compare the namespace an instance would use with those in the store "
        "and say which field keeps them apart. Give the instance's vLLM command line "
        "after -- to compare everything but the layout (else only maru's own fields).",
    )
    add_config_option(doctor)
    doctor.add_argument("vllm_command", nargs=argparse.REMAINDER, metavar="-- vllm serve ...")
    doctor.set_defaults(run=cmd_doctor)
