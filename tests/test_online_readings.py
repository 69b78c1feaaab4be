"""tools.online_readings: the online arms against the plain ones at equal compute and at equal steps, per
seed, on hand-made records whose gaps are known."""

from __future__ import annotations

import json

import pytest

from grit_io import InputFileError
from tools.online_readings import equal_steps_epoch, main, readings, record_curves


def _row(mean: float, itc: float, steps: int | None = None) -> dict:
    return {'mean_r1': mean, 'itc_mean_r1': itc, **({'steps': steps} if steps else {})}


def _records() -> tuple[dict, dict]:
    # JEST at 2232 steps per seed; plain runs of 100 steps an epoch, evaluated at epochs 10, 20, 24.
    compare = {
        'selected_lr': {'JEST': 0.0005, 'random batches': 0.00025, 'B3': [0.0005, 'p=2,m=20']},
        'sweep': {
            'JEST': {'0.0005': {'1': _row(40.0, 50.0, 2232), '2': _row(30.0, 45.0, 2232),
                                '3': _row(35.0, 48.0, 2232)}},
            'random batches': {'0.00025': {'1': _row(50.0, 55.0), '2': _row(46.0, 50.0),
                                           '3': _row(41.0, 47.0)}},
            'B3': {'0.0005 p=2,m=20': {'1': _row(60.0, 61.0), '2': _row(55.0, 58.0)}},
        },
        'reference': {'steps': 2400, 'epochs': 24},
    }
    curve = [{'epoch': e, 'mean_r1': float(e), 'itc_mean_r1': 2.0 * e} for e in (10, 20, 24)]
    curves = {'curves': {'random batches': {'1': curve, '2': curve}, 'B3': {'1': curve, '3': curve}},
              'learning_rates': {'random batches': 0.00025, 'B3': 0.0005}, 'settings': {'B3': 'p=2,m=20'},
              'micro': False}
    return compare, curves


def _curves(record: dict) -> dict:
    """An efficiency record's curves as record_curves gives them: {(arm, seed): points}."""
    return {(arm, int(seed)): points
            for arm, seeds in record['curves'].items() for seed, points in seeds.items()}


def test_equal_steps_epoch_takes_the_last_point_within_the_steps():
    curve = [{'epoch': e} for e in (1, 2, 4, 6, 8)]
    assert equal_steps_epoch(curve, 2232, 363)['epoch'] == 6  # 6 x 363 = 2178 <= 2232 < 8 x 363
    assert equal_steps_epoch(curve, 300, 363) is None


def test_both_readings_by_hand():
    compare, curves = _records()
    out = readings(compare, _curves(curves))
    assert out['plain_steps_per_epoch'] == 100
    random = out['arms']['JEST']['random batches']
    assert random['equal_compute']['mean_r1']['per_seed'] == [-10.0, -16.0, -6.0]
    assert random['equal_compute']['mean_r1']['interval']['behind'] == 3
    assert random['equal_compute']['itc_mean_r1']['per_seed'] == [-5.0, -5.0, 1.0]
    # Equal steps: 2232 steps reach plain epoch 20 (2000 steps), not 24 (2400); seed 3 has no plain curve.
    assert random['equal_steps']['mean_r1']['seeds'] == [1, 2]
    assert random['equal_steps']['mean_r1']['per_seed'] == [20.0, 10.0]
    assert random['equal_steps']['itc_mean_r1']['per_seed'] == [10.0, 5.0]
    assert random['equal_steps_points'][1] == {'online_steps': 2232, 'plain_epoch': 20, 'plain_steps': 2000}
    b3 = out['arms']['JEST']['B3']  # a grid arm, read at its setting; only the seeds both hold
    assert b3['equal_compute']['mean_r1']['seeds'] == [1, 2]
    assert b3['equal_compute']['mean_r1']['per_seed'] == [-20.0, -25.0]
    assert b3['equal_steps']['mean_r1']['seeds'] == [1, 3]
    assert out['arms']['JEST'].keys() == {'random batches', 'B3'}
    # A second online arm: each is read against the other at equal compute (no curve: no equal steps).
    compare['selected_lr']['RHO-LOSS'] = 0.0005
    compare['sweep']['RHO-LOSS'] = {'0.0005': {'1': _row(45.0, 52.0, 2232), '2': _row(31.0, 40.0, 2232)}}
    both = readings(compare, _curves(curves))['arms']
    assert both['JEST']['RHO-LOSS']['equal_compute']['mean_r1']['per_seed'] == [-5.0, -1.0]
    assert both['RHO-LOSS']['JEST']['equal_compute']['itc_mean_r1']['per_seed'] == [2.0, -5.0]
    assert both['JEST']['RHO-LOSS']['equal_steps']['mean_r1']['seeds'] == []
    assert 'RHO-LOSS' not in both['RHO-LOSS']


def test_main_writes_json_and_markdown_and_names_a_bad_record(tmp_path, capsys):
    compare, curves = _records()
    (tmp_path / 'compare.json').write_text(json.dumps(compare))
    (tmp_path / 'curves.json').write_text(json.dumps(curves))
    out = tmp_path / 'out'
    result = main(['--compare', str(tmp_path / 'compare.json'), '--curves', str(tmp_path / 'curves.json'),
                   '--plain', 'random batches', '--output_dir', str(out)])
    printed = json.loads(capsys.readouterr().out.strip())
    assert printed == json.loads((out / 'online_readings.json').read_text())
    assert list(result['arms']['JEST']) == ['random batches']
    table = (out / 'online_readings.md').read_text()
    assert '| JEST | random batches | -10.67 [' in table and '| 20 |' in table
    del compare['sweep']['JEST']['0.0005']['2']['steps']
    (tmp_path / 'compare.json').write_text(json.dumps(compare))
    with pytest.raises(InputFileError, match="compare.json: JEST: rows of seeds \\[2\\] lack 'steps'"):
        main(['--compare', str(tmp_path / 'compare.json'), '--curves', str(tmp_path / 'curves.json')])
    with pytest.raises(InputFileError, match='not a tools.efficiency record'):
        main(['--compare', str(tmp_path / 'compare.json'), '--curves', str(tmp_path / 'compare.json')])


def test_curves_of_several_records_are_merged_and_a_conflict_named(tmp_path):
    compare, curves = _records()
    (tmp_path / 'a.json').write_text(json.dumps(curves))
    later = {**curves, 'curves': {'random batches': {'3': curves['curves']['random batches']['1']}}}
    (tmp_path / 'b.json').write_text(json.dumps(later))
    merged = record_curves([str(tmp_path / 'a.json'), str(tmp_path / 'b.json')], compare)
    assert sorted(s for a, s in merged if a == 'random batches') == [1, 2, 3]
    assert sorted(s for a, s in merged if a == 'B3') == [1, 3]
    later['curves']['random batches']['1'] = [{'epoch': 10, 'mean_r1': 0.0, 'itc_mean_r1': 0.0}]
    (tmp_path / 'b.json').write_text(json.dumps(later))
    with pytest.raises(InputFileError, match='b.json: random batches seed 1 differs'):
        record_curves([str(tmp_path / 'a.json'), str(tmp_path / 'b.json')], compare)
    other = {**curves, 'learning_rates': {**curves['learning_rates'], 'random batches': 0.001}}
    (tmp_path / 'c.json').write_text(json.dumps(other))  # curves at another rate than the selection's
    with pytest.raises(InputFileError, match='c.json: ran random batches at'):
        record_curves([str(tmp_path / 'c.json')], compare)
