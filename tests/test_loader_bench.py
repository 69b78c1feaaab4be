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


def test_loader_bench_times_a_corpus_own_images_and_names_a_missing_one(tmp_path):
    """--from_list: the first --images entries of a json list, their files as they are and their first
    captions with the config's vocabulary; a missing image is named with its list."""
    import pytest
    from PIL import Image

    from grit_io import InputFileError
    from tools import loader_bench

    for i in range(3):
        Image.new('RGBA' if i else 'P', (64, 64)).save(tmp_path / f'{i}.png')
    listed = tmp_path / 'list.json'
    entries = [{'image': f'{i}.png', 'caption': ['a cat', 'a cat, pet']} for i in range(3)]
    listed.write_text(json.dumps(entries))
    (tmp_path / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'a', 'cat']))
    common = ['--config', os.path.join(ROOT, 'configs', 'tiny', 'Pretrain.yaml'), '--repeats', '1',
              '--set', f'vocab_file={tmp_path / "vocab.txt"}']
    result = loader_bench.main([*common, '--images', '2', '--from_list', str(listed)])
    assert result['from_list'] == str(listed) and result['images'] == 2 and 'jpeg' not in result
    sizes = [os.path.getsize(tmp_path / f'{i}.png') for i in range(2)]
    assert result['image_mean_bytes'] == round(sum(sizes) / 2)
    assert result['images_per_s_per_worker']['pipeline'] > 0
    listed.write_text(json.dumps([{'image': 'gone.png', 'caption': 'a cat'}]))
    with pytest.raises(InputFileError, match='gone.png: image of .*list.json does not exist'):
        loader_bench.main([*common, '--from_list', str(listed)])
