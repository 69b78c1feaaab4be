"""tools.loader_bench: per-worker throughput of decode, transform and tokenise, and workers needed."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loader_bench_small(capsys, tmp_path, monkeypatch):
    from tools import loader_bench

    # From another working directory: the default config and the synthetic vocab are the repository's.
    monkeypatch.chdir(tmp_path)
    result = loader_bench.main(['--images', '4', '--size', '160x120', '--repeats', '1',
                                '--step_samples_per_s', '1000', '--output_dir', 'out'])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(printed) == result == json.loads((tmp_path / 'out' / 'loader_bench.json').read_text())
    assert result['config'] == os.path.join(ROOT, 'configs', 'Pretrain.yaml')
    rates = result['images_per_s_per_worker']
    assert all(rates[k] > 0 for k in ('decode', 'transform', 'tokenise', 'pipeline'))
    assert rates['pipeline'] <= min(rates['decode'], rates['transform'], rates['tokenise'])
    assert abs(sum(result['share_of_time'].values()) - 1) < 0.01
    assert result['workers_needed'] == -(-1000 // rates['pipeline'])
    assert result['image_res'] == 256 and result['randaugment'] is True
