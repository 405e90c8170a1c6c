//! Sampling parameters that mean nothing are refused, naming their field.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::{SamplingError, SamplingParams};

fn field_of(params: SamplingParams) -> &'static str {
    match params.validate() {
        Err(SamplingError::Invalid { field, .. }) => field,
        other => panic!("expected an invalid field, got {other:?}"),
    }
}

#[test]
fn nonsense_values_name_their_field() {
    let base = SamplingParams::default;
    assert_eq!(
        field_of(SamplingParams {
            temperature: -0.1,
            ..base()
        }),
        "temperature"
    );
    assert_eq!(
        field_of(SamplingParams {
            temperature: f32::NAN,
            ..base()
        }),
        "temperature"
    );
    // Values that pass a sign check yet overflow the logits (the hostile-input audit's
    // 1e-39) or mean nothing.
    for temperature in [1e-39, 9e-5, 2e4, f32::INFINITY, -1.0] {
        assert_eq!(
            field_of(SamplingParams {
                temperature,
                ..base()
            }),
            "temperature",
            "{temperature}"
        );
    }
    for temperature in [0.0, 1e-4, 0.7, 1e4] {
        let params = SamplingParams {
            temperature,
            ..base()
        };
        assert!(params.validate().is_ok(), "{temperature}");
    }
    for repetition_penalty in [1e-39, 0.009, 101.0, f32::NAN] {
        assert_eq!(
            field_of(SamplingParams {
                repetition_penalty,
                ..base()
            }),
            "repetition_penalty",
            "{repetition_penalty}"
        );
    }
    assert_eq!(
        field_of(SamplingParams {
            top_p: 0.0,
            ..base()
        }),
        "top_p"
    );
    assert_eq!(
        field_of(SamplingParams {
            top_p: 1.5,
            ..base()
        }),
        "top_p"
    );
    assert_eq!(
        field_of(SamplingParams {
            min_p: -1.0,
            ..base()
        }),
        "min_p"
    );
    assert_eq!(
        field_of(SamplingParams {
            repetition_penalty: 0.0,
            ..base()
        }),
        "repetition_penalty"
    );
    assert_eq!(
        field_of(SamplingParams {
            presence_penalty: 3.0,
            ..base()
        }),
        "presence_penalty"
    );
    assert_eq!(
        field_of(SamplingParams {
            frequency_penalty: f32::NAN,
            ..base()
        }),
        "frequency_penalty"
    );
    assert!(base().validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
}
