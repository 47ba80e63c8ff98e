"""`tokenmill env` reports versions, CPU features, the kernel build and what is active."""
import json

import pytest
import torch

import tokenmill
from tokenmill.entrypoints.cli import main
from tokenmill.layers import native


def test_env_json_reports_kernels_versions_and_caches(capsys, tmp_path):
    assert main(["env", "--json", "--cache-dir", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokenmill"]["version"] == tokenmill.__version__
    assert info["packages"]["torch"].startswith(torch.__version__.split("+")[0])
    assert info["caches"]["models"] == str(tmp_path)
    assert info["kernel_library"]["built"] == native.buildable()   # built wherever it can be
    assert info["kernels_active"]["one-call decode stack (cpu_decode.c)"] == native.buildable()
    assert info["gpu"]["cuda_available"] == torch.cuda.is_available()
    assert info["threads"]["torch"] == torch.get_num_threads()


def test_env_text_names_each_section(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for section in ("tokenmill:", "packages:", "cpu:", "kernel_library:", "kernels_active:", "caches:", "gpu:"):
        assert section in out


def test_environment_sets_only_the_cli_defaults(monkeypatch):
    """TOKENMILL_CPU_KERNELS / TOKENMILL_QMM_ACTIVATIONS are read by the CLI into flag
    defaults (explicit flags win); the library itself never reads them."""
    from tokenmill.entrypoints.cli import build_parser
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENMILL_QMM_ACTIVATIONS", "q8")
    args = build_parser().parse_args(["generate", "hi"])
    assert args.cpu_kernels is False and args.quant_activations == "q8"
    args = build_parser().parse_args(["generate", "--cpu-kernels", "--quant-activations", "fp32", "hi"])
    assert args.cpu_kernels is True and args.quant_activations == "fp32"
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "off")
    with pytest.raises(SystemExit, match="TOKENMILL_CPU_KERNELS"):
        build_parser()


def test_library_code_reads_no_tokenmill_setting_from_the_environment():
    import pathlib
    root = pathlib.Path(tokenmill.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if "TOKENMILL_" in p.read_text() and "os.environ" in p.read_text()]
    assert sorted(readers) == ["entrypoints/cli.py", "entrypoints/cli_env.py", "entrypoints/cli_quant.py"]
