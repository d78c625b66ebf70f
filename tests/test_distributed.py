"""trustrl.remote without starting Ray: lazy import, the missing-Ray message, and the
settings refused before anything starts. (The Ray instance itself: test_ray_cluster.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from trustrl.remote import INSTALL_HINT, RayCluster, RayUnavailableError, import_ray


def test_importing_the_package_does_not_import_ray():
    code = "import sys, trustrl.remote; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds when absent
    with pytest.raises(RayUnavailableError, match=r"pip install 'trustrl\[ray\]'"):
        import_ray(loopback=True)
    with pytest.raises(RayUnavailableError) as missing:
        RayCluster().start()
    assert INSTALL_HINT in str(missing.value)
    assert isinstance(missing.value, ImportError)


@pytest.mark.parametrize("mode", ["disabled", "k8s"])
def test_local_instance_refuses_to_start_without_token_authentication(monkeypatch, mode):
    monkeypatch.setenv("RAY_AUTH_MODE", mode)
    with pytest.raises(ValueError, match="token authentication"):
        RayCluster().start()


def test_num_cpus_is_checked():
    with pytest.raises(ValueError, match="num_cpus"):
        RayCluster(num_cpus=0)


def test_runners_without_ray_is_one_error_line_with_the_install_command(
    tmp_path, monkeypatch, capsys
):
    from trustrl.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds when absent
    code = main(["train", "CartPole-v1", "--runners.count", "2", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("trustrl: error:") and INSTALL_HINT in err
    assert "Traceback" not in err
