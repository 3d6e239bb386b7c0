"""`python -m aggregator study ...`: the operator creates, lists, pauses, resumes and cancels the aggregator's
studies, over mutual TLS with an operator certificate, as `status` asks (`aggregator.status.ask`).

What the operator can get wrong here (an id no study can have, a study file that is missing or not text) is
said before dialling, exit 2; the aggregator checks the study file itself and lists its problems.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import Message

from fedlt.errors import FedltError
from fedlt.studies import ID_FORM, id_problems
from fedlt.v1 import operator_pb2


def add_operator_options(parser: argparse.ArgumentParser) -> None:
    """What every command that dials the aggregator as its operator takes (`status` and `study ...`)."""
    parser.add_argument("--config", required=True, help="consortium.toml (for the address and CA)")
    parser.add_argument("--cert", required=True, help="operator certificate (from `ca issue-operator`)")
    parser.add_argument("--key", required=True, help="operator key")
    parser.add_argument(
        "--address", help="host:port to dial (default: where the aggregator bound, or [server] listen)"
    )


def add_study_parser(subparsers: argparse._SubParsersAction) -> None:
    what = "the aggregator's studies: create, list, pause, resume and cancel them"
    study = subparsers.add_parser("study", help=what, description=what)
    commands = study.add_subparsers(dest="study_command", required=True, metavar="COMMAND")
    create = _command(commands, "create", "queue a new study from its study file", _create, "created")
    _id_option(create)
    create.add_argument("--plan", type=Path, required=True, help="the study file (TOML)")
    _command(commands, "list", "every study: its layers, rounds and where it stands", _list, verb=None)
    _id_option(_command(commands, "pause", "stop a study where it is; its silos wait", _pause, "paused"))
    _id_option(_command(commands, "resume", "go on with a paused or failed study", _resume, "resumed"))
    cancel = _command(commands, "cancel", "end a study for good (its record stays)", _cancel, "cancelled")
    _id_option(cancel)
    cancel.add_argument("--reason", default="", help="why, one line (kept in the study's audit log)")


def run_study(args: argparse.Namespace) -> int:
    """Raises `aggregator.status.NoAnswer` where the aggregator refuses or does not answer."""
    from aggregator.config import load_consortium_config  # the aggregator's modules: loaded only to dial
    from aggregator.status import ask, standing, studies_table

    rpc, request = args.request(args)
    config = load_consortium_config(args.config)
    answer = ask(config, rpc, request, cert=args.cert, key=args.key, address=args.address)
    if args.verb is None:
        print("\n".join(studies_table(answer.studies)))
    else:
        print(f"{args.verb} study {answer.study.id!r}, now {standing(answer.study)}")
    return 0


def _command(
    commands: argparse._SubParsersAction,
    name: str,
    help_text: str,
    request: Callable[[argparse.Namespace], tuple[str, Message]],
    verb: str | None,
) -> argparse.ArgumentParser:
    """`request`: the RPC and its request, or a FedltError saying what the operator got wrong; `verb`: what
    the command did to the study it answers with (None: it answers with the list)."""
    parser = commands.add_parser(name, help=help_text, description=help_text)
    add_operator_options(parser)
    parser.set_defaults(request=request, verb=verb)
    return parser


def _id_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", required=True, help=f"the study's id: {ID_FORM}")


def _create(args: argparse.Namespace) -> tuple[str, Message]:
    return "CreateStudy", operator_pb2.CreateStudyRequest(
        id=_study_id(args.id), study_toml=_study_file(args.plan)
    )


def _list(_args: argparse.Namespace) -> tuple[str, Message]:
    return "ListStudies", operator_pb2.ListStudiesRequest()


def _pause(args: argparse.Namespace) -> tuple[str, Message]:
    return "PauseStudy", operator_pb2.PauseStudyRequest(id=_study_id(args.id))


def _resume(args: argparse.Namespace) -> tuple[str, Message]:
    return "ResumeStudy", operator_pb2.ResumeStudyRequest(id=_study_id(args.id))


def _cancel(args: argparse.Namespace) -> tuple[str, Message]:
    return "CancelStudy", operator_pb2.CancelStudyRequest(id=_study_id(args.id), reason=args.reason)


def _study_id(study: str) -> str:
    problems = id_problems(study, "--id")
    if problems:
        raise FedltError(problems[0])
    return study


def _study_file(path: Path) -> str:
    """The study file as the aggregator takes it: UTF-8 text (it checks the size and the settings)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FedltError(f"--plan {path}: {exc.strerror.lower() if exc.strerror else exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FedltError(f"--plan {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
