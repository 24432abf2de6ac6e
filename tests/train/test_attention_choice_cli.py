"""The main job refuses an attention kernel that cannot run (cuDNN on the CPU) before building, with the reason."""
from recipes import train


def test_the_main_job_refuses_cudnn_on_the_cpu_before_building(capsys):
    assert train.main(["--set", "attention_impl=cudnn", "--steps", "1", "--xla-flags", "none"]) == 2
    assert "attention_impl='cudnn' cannot run here" in capsys.readouterr().err
