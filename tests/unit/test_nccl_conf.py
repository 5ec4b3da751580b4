"""NCCL's configuration files as NCCL reads them, and the worker leaving their NVLS setting.

NCCL applies a file's settings only where the environment does not set the variable, so
``NCCL_NVLS_ENABLE=0`` from ``devices.nccl_env`` would override an administrator's
``/etc/nccl.conf``: the worker reads the files first (``nccl_conf``).
"""

from __future__ import annotations

from pathlib import Path

from sailor.megatron_patch.devices import nccl_env
from sailor.megatron_patch.nccl_conf import (
    SYSTEM_CONF,
    conf_files,
    nccl_conf_settings,
    parse_nccl_conf,
    read_nccl_conf,
)


def test_lines_are_cut_as_nccl_cuts_them() -> None:
    text = (
        "# NCCL_NVLS_ENABLE=1\n"
        "NCCL_DEBUG=WARN\r\n"
        "NCCL_SOCKET_IFNAME==ens1f0\n"  # the value is everything after the first '='
        "NCCL_IB_HCA = mlx5\n"  # blanks kept: a name no NCCL variable matches
        "no equals sign\n"
        "NCCL_DEBUG=INFO\n"  # the first of a name wins
        "NCCL_NVLS_ENABLE="
    )
    assert parse_nccl_conf(text) == {
        "NCCL_DEBUG": "WARN\r",  # NCCL drops the '\n' only: a CRLF file's '\r' stays
        "NCCL_SOCKET_IFNAME": "=ens1f0",
        "NCCL_IB_HCA ": " mlx5",
        "NCCL_NVLS_ENABLE": "",
    }
    # NCCL's buffers hold 1023 characters of a name and of a value
    assert parse_nccl_conf(f"{'N' * 1030}={'v' * 1030}\n") == {"N" * 1023: "v" * 1023}


def test_the_user_file_is_read_before_the_system_one() -> None:
    assert conf_files({}, "/home/u") == ["/home/u/.nccl.conf", SYSTEM_CONF]
    assert conf_files({"NCCL_CONF_FILE": "/x.conf"}, "/home/u") == ["/x.conf", SYSTEM_CONF]
    assert conf_files({"NCCL_CONF_FILE": ""}, None) == [SYSTEM_CONF]
    files = {"/home/u/.nccl.conf": "NCCL_NVLS_ENABLE=1\n", SYSTEM_CONF: "NCCL_NVLS_ENABLE=0\nA=b\n"}
    got = nccl_conf_settings({}, "/home/u", files.get)
    assert got == {"NCCL_NVLS_ENABLE": "1", "A": "b"}
    assert nccl_conf_settings({}, None, files.get) == {"NCCL_NVLS_ENABLE": "0", "A": "b"}


def test_a_file_setting_of_nvls_is_left_to_apply(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_NVLS_ENABLE=1\n")
    settings = read_nccl_conf({"NCCL_CONF_FILE": str(conf)})
    assert settings["NCCL_NVLS_ENABLE"] == "1"
    assert "NCCL_NVLS_ENABLE" not in nccl_env({}, settings)
    assert nccl_env({}, {})["NCCL_NVLS_ENABLE"] == "0"
    # read as NCCL reads it: a CRLF line keeps its '\r', a lone '\r' ends no line
    conf.write_bytes(b"NCCL_DEBUG=WARN\r\nNCCL_NVLS_ENABLE=1\rNCCL_ALGO=Ring\n")
    got = read_nccl_conf({"NCCL_CONF_FILE": str(conf)})
    assert (got["NCCL_DEBUG"], got["NCCL_NVLS_ENABLE"]) == ("WARN\r", "1\rNCCL_ALGO=Ring")
    # a file that cannot be read is skipped, as NCCL skips it
    gone = read_nccl_conf({"NCCL_CONF_FILE": str(tmp_path / "missing.conf")})
    assert "NCCL_NVLS_ENABLE" not in gone or Path(SYSTEM_CONF).exists()
