"""`python -m silo run --config silo.toml`: run this silo's agent until the consortium finishes. With
`[study.<id>]` tables in silo.toml, one agent process per study, until every study has ended (`silo.studies`);
`--study <id>` runs that study's agent alone, in the foreground.

`python -m silo roster show|sign --config silo.toml`: show the roster this silo has pinned (its own row
marked, its certificate checked against it), or add this silo's signature to a roster draft the operator
sent (a new version counts once a quorum of silos signed it).

`python -m silo keys rotate --config silo.toml [--layer NAME]`: as the consortium's key holder (a layer with
a key service, e.g. ckks; `--layer` picks one where the policy lists several), make a new key; the running
agent seals it to every silo at its next heartbeat, and the next RoundSpec names it. Each study has its own
keys: name it with `--study <id>` where silo.toml has `[study.<id>]` tables.

`python -m silo budget --config silo.toml`: this silo's differential-privacy budget, what it has spent and on
what (its ledger, which the agent charges before any private work).

`python -m silo export --config silo.toml --out DIR [--study ID]`: the model this silo last stepped to (where
only silos can read the consortium's state, e.g. ckks), as safetensors weights with a model card; it fetches
nothing.

`python -m silo models pin package.module:factory`: the `[policy] models` item that lets plans name this
model, with the digest of its installed source (`silo.models`), computed without importing it; run it in the
agent's environment and folder, where the agent will look the package up.

`python -m silo certificate-request --config silo.toml --out FILE`: a certificate request for this silo's
key (made, owner-only, if `[connection] key` does not exist yet), for the CA holder to issue or renew its
certificate without the key leaving the silo (`python -m aggregator ca issue-silo|renew-silo --csr FILE`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from cryptography import x509

from fedlt.errors import FedltError
from privacy.pki.errors import PkiError
from privacy.pki.identity import read_certificate, silo_id_of
from privacy.pki.renewal import certificate_request, new_private_key
from privacy.pki.roster import SILO, Roster, fingerprint, minimum_quorum
from privacy.pki.signing import load_private_key
from silo.config import SiloConfig, load_silo_config
from silo.trust import check_roster_floor, pinned_roster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="connect to the aggregator and take part in rounds")
    run.add_argument("--config", required=True, help="silo.toml")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.add_argument(
        "--study", help="run only this study's agent, in the foreground (a [study.<id>] table of silo.toml)"
    )
    roster = commands.add_parser("roster", help="show the pinned roster, or sign a new version")
    roster_commands = roster.add_subparsers(dest="roster_command", required=True)
    show = roster_commands.add_parser("show", help="the roster this silo trusts now")
    show.add_argument("--config", required=True, help="silo.toml")
    sign = roster_commands.add_parser("sign", help="add this silo's signature to a roster draft, in place")
    sign.add_argument("--config", required=True, help="silo.toml")
    sign.add_argument("draft", type=Path, help="the roster draft (python -m aggregator roster draft)")
    keys = commands.add_parser("keys", help="the key this silo holds as the consortium's key holder")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    rotate = keys_commands.add_parser("rotate", help="make a new consortium key (key holder only)")
    rotate.add_argument("--config", required=True, help="silo.toml")
    rotate.add_argument(
        "--layer", help="the privacy layer whose key to rotate (needed where policy.privacy lists several)"
    )
    rotate.add_argument("--study", help="the study whose key to rotate (where silo.toml names studies)")
    budget = commands.add_parser("budget", help="this silo's privacy budget, spending and ledger")
    budget.add_argument("--config", required=True, help="silo.toml")
    export = commands.add_parser(
        "export", help="write the model this silo last stepped to (where silos step it), with a model card"
    )
    export.add_argument("--config", required=True, help="silo.toml")
    export.add_argument("--out", type=Path, required=True, help="a new or empty folder to write it to")
    export.add_argument("--study", help="the study whose model to write (where silo.toml names studies)")
    request = commands.add_parser(
        "certificate-request", help="a request for a renewed certificate of this silo's key (it stays here)"
    )
    request.add_argument("--config", required=True, help="silo.toml")
    request.add_argument("--out", type=Path, required=True, help="where to write the request (PEM)")
    request.add_argument("--silo-id", help="this silo's id (default: the one its certificate names)")
    models = commands.add_parser("models", help="the model entry points this silo's policy pins")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pin = models_commands.add_parser(
        "pin", help="print the [policy] models item for an entry point, from its installed source"
    )
    pin.add_argument("entry", help="package.module:factory")
    args = parser.parse_args(argv)
    study = getattr(args, "study", None)
    running = ""  # the study whose agent runs here: its lines interleave with its other studies'
    try:
        if args.command == "models":
            from silo.models import pin_line  # torch loads (fedlt.models); the entry point's package does not

            print(pin_line(args.entry))
            return 0
        config = load_silo_config(args.config)
        if args.command == "budget":
            from silo.budget import show_budget  # NumPy and Opacus' accountant load only for this command

            return show_budget(config)
        if args.command == "keys":
            return _rotate_key(_one_study(config, study, "keys rotate"), args.layer)
        if args.command == "export":
            from silo.export import export_stepped  # torch and TenSEAL load only for this command

            return export_stepped(_one_study(config, study, "export"), args.out)
        if args.command == "certificate-request":
            return _certificate_request(config, args.out, args.silo_id)
        if args.command == "roster":
            return _show_roster(config) if args.roster_command == "show" else _sign_roster(config, args.draft)
        if config.studies and study is None:
            return _run_studies(config, Launch(args.config, args.log_level))
        config = _one_study(config, study, "run")
        running = config.study
        return _run(config, args.log_level)
    except FedltError as exc:
        print(f"error: {f'study {running!r}: ' if running else ''}{exc}", file=sys.stderr)
        return 2


def _one_study(config: SiloConfig, study: str | None, command: str) -> SiloConfig:
    """The config of the study `--study` names; the config itself for a silo without studies."""
    if study is not None:
        if not config.studies:
            raise FedltError(
                f"--study {study!r}: silo.toml names no studies ([study.<id>] tables); without them the "
                "agent takes part in the aggregator's default study: leave --study out"
            )
        return config.for_study(study)
    if config.studies:
        raise FedltError(
            f"silo.toml names studies ({', '.join(config.study_ids)}): say which study's with "
            f"python -m silo {command} --study <id>"
        )
    return config


def _logging(log_level: str, study: str) -> None:
    """Each line says which study's agent wrote it, where there are several (their lines interleave)."""
    where = f" [{study}]" if study else ""
    # force: Opacus configures the root logger when imported (opacus/utils/module_utils.py)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(name)s{where} %(levelname)s %(message)s", force=True
    )


def _run(config: SiloConfig, log_level: str) -> int:
    from silo.agent import SiloAgent  # torch and gRPC load only for the agent

    _logging(log_level, config.study)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return SiloAgent(config, stop=stop).run()


@dataclass(frozen=True)
class Launch:
    """How this command was started, for the command line of each study's agent."""

    config: str
    log_level: str

    def study(self, study: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "silo",
            "run",
            "--config",
            str(Path(self.config).resolve()),
            "--study",
            study,
            "--log-level",
            self.log_level,
        ]


def _run_studies(config: SiloConfig, launch: Launch) -> int:
    from silo.studies import Supervisor, forward_signals, note_single_run

    _logging(launch.log_level, "")
    note_single_run(config.shared_dir(), config.study_ids)
    supervisor = Supervisor(config.study_ids, launch.study)
    restore = forward_signals(supervisor)
    try:
        return supervisor.run()
    finally:
        restore()


def _rotate_key(config: SiloConfig, layer: str | None) -> int:
    """Runs beside the agent, which shares the new key at its next heartbeat, so it takes no state-directory
    lock (`fedlt.dir_lock`): it only adds a key file and repoints `<layer>/current`, each atomically, and
    rewrites nothing it read, so no record of the agent's can be lost."""
    from silo.key_service import keyrings  # the layers (TenSEAL for ckks) load only for this command

    found = keyrings(config.path(config.state_dir), config.policy.privacy)
    if not found:
        raise FedltError(
            f"policy.privacy ({', '.join(config.policy.privacy)}) lists no layer with a key service: this "
            "silo holds no consortium key to rotate"
        )
    if layer is None and len(found) > 1:
        raise FedltError(
            f"policy.privacy lists several layers with a key service ({', '.join(found)}): name the one "
            "whose key to rotate with --layer"
        )
    if layer is not None and layer not in found:
        raise FedltError(
            f"--layer {layer!r}: policy.privacy lists no such layer with a key service; it lists "
            f"{', '.join(found)}"
        )
    keyring = found[layer] if layer is not None else next(iter(found.values()))
    secret = keyring.rotate()
    print(
        f"new {keyring.layer} key {secret.context_id[:16]}; the running agent shares it at its next heartbeat"
    )
    return 0


def _pinned(config: SiloConfig) -> Roster:
    return pinned_roster(config.path(config.state_dir), config.path(config.connection.roster))


def _show_roster(config: SiloConfig) -> int:
    """The pinned roster with this silo's row marked, and whether the certificate this silo presents is the
    one the roster names for it: the aggregator and every peer refuse any other, so exit 1 if not."""
    roster, path = _pinned(config), config.path(config.connection.certificate)
    cert = read_certificate(path)
    me = silo_id_of(cert)
    for line in roster.describe().splitlines():
        print(f"* {line[2:]}  (this silo)" if line.split()[:2] == [SILO, me] else line)
    problem = _own_certificate_problem(roster, cert, path)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"this silo, {me}: its certificate {path} is the one the roster names")
    return 0


def _own_certificate_problem(roster: Roster, cert: x509.Certificate, path: Path) -> str:
    """Why peers holding `roster` would refuse `cert` (this silo's, from `path`), and what resolves it."""
    me, mine = silo_id_of(cert), fingerprint(cert)
    named = roster.member(me)
    where = f"roster v{roster.version} of {roster.consortium!r}"
    if named is None:
        return (
            f"{where} names no silo {me!r} (the id in {path}): the aggregator and every peer will refuse "
            f"this silo; ask the operator for a roster naming it (--silo {me}=<its certificate>)"
        )
    if named.fingerprint == mine:
        return ""
    fix = (
        "it renews the same key, and counts once a roster naming it is in force (python -m silo roster sign)"
        if named.cert.public_key() == cert.public_key()
        else "install the certificate the roster names, or ask the operator for a roster naming this one"
    )
    return (
        f"{where} names another certificate for {me} (sha256 {named.fingerprint[:16]}…) than {path} "
        f"(sha256 {mine[:16]}…): the aggregator and every peer will refuse it; {fix}"
    )


def _sign_roster(config: SiloConfig, path: Path) -> int:
    """Sign only a draft that could follow the pinned roster and whose quorum this silo's policy accepts,
    as a silo member of the pinned roster.

    Peers check the signature with the key of the certificate the pinned roster names, so what matters is
    that this silo's key is that certificate's: a renewed certificate of the same key (a certificate request)
    may already be installed; a renewed key may not, until the roster naming it is adopted."""
    pinned, draft = _pinned(config), Roster.read(path)
    if draft.consortium != pinned.consortium or draft.version <= pinned.version:
        raise FedltError(
            f"{path} is v{draft.version} of {draft.consortium!r}; this silo holds v{pinned.version} of "
            f"{pinned.consortium!r}, so it can only sign a later version of the same consortium"
        )
    floor = Fraction(config.policy.roster_quorum_above)
    try:
        check_roster_floor(draft, floor)
    except PkiError as exc:
        wanted = minimum_quorum(len(draft.silo_ids), floor)
        raise FedltError(
            f"not signing {path}, which this silo would not adopt: {exc}; ask the operator for a draft "
            f"with --quorum {wanted} or more"
        ) from None
    conn = config.connection
    key = load_private_key(config.path(conn.key))
    try:
        me = pinned.member_of(read_certificate(config.path(conn.certificate)), role=SILO)
    except FedltError:
        me = next(
            (m for m in pinned.members if m.role == SILO and m.cert.public_key() == key.public_key()), None
        )
        if me is None:
            raise FedltError(
                f"roster v{pinned.version}, which this silo holds, names neither the certificate in "
                f"{config.path(conn.certificate)} nor its key ({config.path(conn.key)}): sign with the key "
                "of the certificate the roster names (sign a draft before installing a renewed certificate "
                "and key over the old ones)"
            ) from None
    print(draft.describe())
    signed = draft.signed_by(me, key)
    path.write_bytes(signed.to_json())
    print(
        f"signed as {me.id}: {len(signed.signatures)} signatures now; v{pinned.version} needs {pinned.quorum}"
    )
    return 0


def _certificate_request(config: SiloConfig, out: Path, silo_id: str | None) -> int:
    """A request for this silo's key (a new one if there is none yet), naming its id."""
    conn = config.connection
    key_path, cert_path = config.path(conn.key), config.path(conn.certificate)
    if silo_id is None:
        if not cert_path.exists():
            raise FedltError(f"{cert_path} does not exist yet: give this silo's id with --silo-id")
        silo_id = silo_id_of(read_certificate(cert_path))
    new = not key_path.exists()
    key = new_private_key(key_path) if new else load_private_key(key_path)
    out.write_bytes(certificate_request(key, silo_id))
    made = "a new key, made owner-only in" if new else "its key, which stays in"
    print(f"wrote {out}: a certificate request for {silo_id}'s key ({made} {key_path})")
    command = "renew-silo" if cert_path.exists() else "issue-silo"
    print(
        f"next: send it to the CA holder (python -m aggregator ca {command} --silo-id {silo_id} --csr "
        f"{out.name} ...) and install the certificate you get back as {cert_path}"
        + (
            "; a renewed certificate counts once a roster naming it is in force (sign that roster draft "
            "first): the running agent switches to it then"
            if cert_path.exists()
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
