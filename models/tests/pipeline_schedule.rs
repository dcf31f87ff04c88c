//! The activation planner's in-flight micro-batch counts agree with the pipeline schedules
//! `moe_backend::parallel::schedule` actually produces.

use moe_backend::parallel::schedule::PipelineSchedule;
use moe_models::plan::activations::in_flight_per_chunk;

#[test]
fn planner_in_flight_matches_the_schedule_peak() {
    for pp in [1, 2, 4, 8] {
        for vpp in [1, 2, 3, 4] {
            for m in [pp, 2 * pp, 4 * pp, 8 * pp, 16 * pp] {
                let s = PipelineSchedule::interleaved(pp, vpp, m).unwrap();
                for stage in 0..pp {
                    let planner = in_flight_per_chunk(pp, vpp, stage, m);
                    assert_eq!(
                        s.in_flight_at_peak(stage),
                        planner,
                        "pp {pp} vpp {vpp} m {m} stage {stage}"
                    );
                    assert_eq!(s.max_in_flight(stage), planner.iter().sum::<usize>());
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_planner_matches_for_any_microbatch_count() {
    for pp in [2, 3, 4] {
        for m in 1..=10 {
            let s = PipelineSchedule::one_f_one_b(pp, m).unwrap();
            for stage in 0..pp {
                assert_eq!(
                    vec![s.max_in_flight(stage)],
                    in_flight_per_chunk(pp, 1, stage, m),
                    "pp {pp} m {m} stage {stage}"
                );
            }
        }
    }
}
