"""tools.seed_noise: the seed noise of every ordering of a tools.compare record, against hand-computed values
and scipy."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from grit_io import InputFileError
from tools.seed_noise import main, markdown, noise, seeds_needed


def record() -> dict:
    """A compare record: GRIT-VLP at 5e-4, B3 at (5e-4, 'p=2,m=20'), random at 2.5e-4, seeds 1-3 (B3 also 4),
    a second rate of GRIT-VLP that must not be read."""
    def rows(values):
        return {str(s): {'mean_r1': v, 'itc_mean_r1': v / 2, 'r_mean': 80 + v / 10}
                for s, v in values.items()}
    return {'selected_lr': {'GRIT-VLP': 0.0005, 'B3': [0.0005, 'p=2,m=20'], 'random batches': 0.00025},
            'sweep': {'GRIT-VLP': {'0.0005': rows({1: 60.0, 2: 62.0, 3: 64.0}),
                                   '0.001': rows({1: 0.0, 2: 0.0, 3: 0.0})},
                      'B3': {'0.0005 p=2,m=20': rows({1: 59.0, 2: 60.0, 3: 61.0, 4: 99.0})},
                      'random batches': {'0.00025': rows({1: 50.0, 2: 50.0, 3: 50.0})}}}


def test_seeds_needed_by_hand():
    # gaps 1, 2, 3: mean 2, std 1; half-widths t(.975, n-1)/sqrt(n): 8.98 (n=2), 2.48 (3), 1.59 (4) < 2
    assert seeds_needed(2.0, 1.0) == 4
    assert seeds_needed(-2.0, 1.0) == 4  # the sign does not matter
    assert seeds_needed(0.0, 1.0) is None and seeds_needed(math.nan, 1.0) is None
    assert seeds_needed(0.1, 10.0, max_seeds=50) is None  # would need ~40,000
    assert seeds_needed(1.0, 0.0) == 2


@pytest.mark.parametrize("mean,std", [(2.05, 2.43), (4.18, 3.67), (0.5, 1.0)])
def test_seeds_needed_is_the_first_n_whose_scipy_interval_excludes_zero(mean, std):
    n = seeds_needed(mean, std, max_seeds=1000)
    def excludes(k: int) -> bool:
        low, high = stats.t.interval(0.95, k - 1, loc=mean, scale=std / math.sqrt(k))
        return low > 0 or high < 0
    assert excludes(n) and not excludes(n - 1)


def test_noise_pairs_each_arm_with_the_baseline_at_both_selections():
    out = noise(record(), 'GRIT-VLP', ['mean_r1', 'itc_mean_r1', 'r_mean'])
    assert set(out) == {'B3', 'random batches'}
    b3 = out['B3']['mean_r1']
    assert b3['seeds'] == [1, 2, 3]  # B3's seed 4 has no GRIT-VLP partner
    assert b3['per_seed'] == [-1.0, -2.0, -3.0]  # arm minus baseline, the selected rate only
    assert b3['mean'] == pytest.approx(-2.0) and b3['std'] == pytest.approx(1.0)
    assert b3['standardised'] == pytest.approx(-2.0) and b3['seeds_needed'] == 4
    low, high = stats.t.interval(0.95, 2, loc=-2.0, scale=1.0 / math.sqrt(3))
    assert (b3['interval']['low'], b3['interval']['high']) == (pytest.approx(low), pytest.approx(high))
    assert (b3['interval']['ahead'], b3['interval']['behind']) == (0, 3)
    # a figure on another scale: the same standardised gap
    assert out['B3']['r_mean']['standardised'] == pytest.approx(b3['standardised'])
    assert out['B3']['r_mean']['std'] == pytest.approx(0.1)
    assert out['random batches']['itc_mean_r1']['per_seed'] == [-5.0, -6.0, -7.0]


def test_bad_input_names_the_file_and_what_is_wrong(tmp_path):
    path = tmp_path / 'compare.json'
    path.write_text(json.dumps(record()))
    with pytest.raises(InputFileError, match=r"compare\.json.*'ALBEF' is not an arm"):
        main(['--compare', str(path), '--baseline', 'ALBEF'])
    broken = record()
    del broken['sweep']['B3']['0.0005 p=2,m=20']['2']['r_mean']
    path.write_text(json.dumps(broken))
    with pytest.raises(InputFileError, match=r"seeds \[2\] lack 'r_mean'"):
        main(['--compare', str(path)])
    path.write_text(json.dumps({'rows': []}))
    with pytest.raises(InputFileError, match='not a tools.compare record'):
        main(['--compare', str(path)])


def test_command_line_writes_the_record_and_its_table(tmp_path, capsys):
    path = tmp_path / 'compare.json'
    path.write_text(json.dumps(record()))
    result = main(['--compare', str(path), '--figures', 'mean_r1', '--output_dir', str(tmp_path / 'out')])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed['arms']['B3']['mean_r1']['seeds_needed'] == 4
    assert result['arms']['B3']['mean_r1']['seeds_needed'] == 4
    table = (tmp_path / 'out' / 'seed_noise.md').read_text()
    assert table == markdown(result)
    row = '| B3 | mean_r1 | 3 | -2.00 | 1.00 | -2.00 | [-4.48, +0.48] | 0 / 3 | 4 | [-6.97, +2.97] |'
    assert row in table
    assert json.loads((tmp_path / 'out' / 'seed_noise.json').read_text())['baseline'] == 'GRIT-VLP'


def test_fit_seeds_holds_the_other_seeds_out_and_counts_them_inside_each_interval():
    rec = record()
    rec['sweep']['GRIT-VLP']['0.0005']['4'] = {'mean_r1': 60.0, 'itc_mean_r1': 30.0, 'r_mean': 86.0}
    # B3's seed 4 (gap +39) lies outside both intervals of seeds 1-3; random batches has no seed 4
    out = noise(rec, 'GRIT-VLP', ['mean_r1'], fit_seeds=[1, 2, 3])
    b3 = out['B3']['mean_r1']
    assert b3['seeds'] == [1, 2, 3] and b3['held_out']['per_seed'] == {4: 39.0}
    assert (b3['held_out']['inside_interval'], b3['held_out']['inside_prediction']) == (0, 0)
    assert out['random batches']['mean_r1']['held_out']['per_seed'] == {}
    low, high = stats.t.interval(0.95, 2, loc=-2.0, scale=1.0 * math.sqrt(1 + 1 / 3))
    assert b3['prediction']['low'] == pytest.approx(low) and b3['prediction']['high'] == pytest.approx(high)
    rec['sweep']['B3']['0.0005 p=2,m=20']['4']['mean_r1'] = 58.0  # gap -2: inside both
    b3 = noise(rec, 'GRIT-VLP', ['mean_r1'], fit_seeds=[1, 2, 3])['B3']['mean_r1']
    assert (b3['held_out']['inside_interval'], b3['held_out']['inside_prediction']) == (1, 1)
    with pytest.raises(ValueError, match=r'--fit_seeds \[9\]: B3 and GRIT-VLP are not both'):
        noise(rec, 'GRIT-VLP', ['mean_r1'], fit_seeds=[1, 2, 9])
