"""User mistakes at the silo and aggregator command lines: one clear message, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from aggregator.__main__ import main as aggregator_main
from silo.__main__ import main as silo_main


def run(main, argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_silo_config_missing(tmp_path, capsys):
    code, err = run(silo_main, ["run", "--config", str(tmp_path / "silo.toml")], capsys)
    assert code == 2
    assert "no such file" in err


def test_silo_config_problems_are_listed_together(tmp_path, capsys):
    path = tmp_path / "silo.toml"
    path.write_text(
        '[connection]\naggregater = "x"\n[policy]\nmethods = ["fedsgd"]\n[data]\nsource = "files"\n'
    )
    code, err = run(silo_main, ["run", "--config", str(path)], capsys)
    assert code == 2
    assert "connection.aggregater: unknown setting (did you mean 'aggregator'?)" in err
    assert "policy.methods: unknown ['fedsgd']" in err
    assert "data.path: required when data.source = 'files'" in err


def test_silo_with_missing_data_names_the_file(tmp_path, capsys):
    path = tmp_path / "silo.toml"
    path.write_text('[data]\nsource = "files"\npath = "no-such-dir/train.npz"\n')
    code, err = run(silo_main, ["run", "--config", str(path)], capsys)
    assert code == 2
    assert "no-such-dir/train.npz" in err


def test_aggregator_without_certificates_names_them(tmp_path, capsys):
    path = tmp_path / "consortium.toml"
    path.write_text('[consortium]\nid = "x"\n')
    code, err = run(aggregator_main, ["serve", "--config", str(path)], capsys)
    assert code == 2
    assert "server.certificate: no such file" in err
    assert "server.key: no such file" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[consortium]\nrounds = 0\n", "consortium.rounds: must be >= 1"),
        ("[consortum]\nid = 'x'\n", "consortum: unknown section or setting"),
        ("[model]\nimage_shape = [1, 28]\n", "model.image_shape"),
        ("[evaluation]\ndataset = 'mnist5k'\nclass_counts = [1, 2]\n", "2 counts for 10 classes"),
        ("[consortium]\nmin_silos = 1\n", "a secure sum needs at least 2 silos"),
        ("[secagg]\nneighbours = 3\n", "secagg.neighbours: must be even"),
        ("[secagg]\nk_min = -1\n", "secagg.k_min: must be >= 0"),
    ],
)
def test_aggregator_config_problems(tmp_path, capsys, text, message):
    path = tmp_path / "consortium.toml"
    path.write_text(text)
    code, err = run(aggregator_main, ["serve", "--config", str(path)], capsys)
    assert code == 2
    assert message in err


def test_status_asks_for_an_address_when_the_aggregator_listens_on_every_interface(tmp_path, capsys):
    """`listen = "0.0.0.0:50051"` is not a name the certificate holds: dialling it fails TLS with a message
    about hostname verification; the command says what to give instead."""
    from tests.consortium_harness import write_kit

    write_kit(tmp_path, silos=2)
    config = tmp_path / "consortium.toml"
    config.write_text(config.read_text().replace('listen = "127.0.0.1:0"', 'listen = "0.0.0.0:50051"'))
    code, err = run(
        aggregator_main, ["status", "--config", str(config), "--cert", "op.pem", "--key", "op.key"], capsys
    )
    assert code == 2
    assert "--address" in err


def test_status_of_an_aggregator_that_is_not_running_says_so(tmp_path, capsys):
    """Found walking through the operator guide: after a study the aggregator stops, and status printed
    gRPC's UNAVAILABLE line; it says that no aggregator answers, and why that may be."""
    import socket

    from tests.consortium_harness import write_kit

    write_kit(tmp_path, silos=2)
    with socket.socket() as closed:  # a port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    pki = tmp_path / "pki"
    code, err = run(
        aggregator_main,
        [
            "status",
            "--config",
            str(tmp_path / "consortium.toml"),
            "--cert",
            str(pki / "operator.pem"),
            "--key",
            str(pki / "operator.key"),
            "--address",
            f"127.0.0.1:{port}",
        ],
        capsys,
    )
    assert code == 1
    assert f"no aggregator answers at 127.0.0.1:{port}: is it running?" in err
