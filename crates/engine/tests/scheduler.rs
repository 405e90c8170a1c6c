//! The engine's scheduling, stopping and streaming, on a scripted model: no weights, the next
//! token is a function of the last token and its position, and the cache is planned (so blocks
//! are really reserved and freed) but never read.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::collections::HashMap;

use kiln_core::ids::TokenText;
use kiln_core::kv_cache::{CacheKind, KvCache, KvLayout};
use kiln_core::sampling::SamplingParams;
use kiln_core::testing::{Recording, Scripted, Soft};
use kiln_core::{CausalLm, Dtype, TokenId};
use kiln_engine::{
    BeamSearch, CacheSpec, Completion, DraftSource, EarlyStopping, Engine, EngineConfig,
    EngineError, Event, FinishReason, Grammar, GrammarCompiler, OutputConstraint, Request,
    Speculation, StepPolicy,
};

type B = burn::backend::Flex;

/// The scripted models' vocabulary. The stand-ins (`Scripted`: one-hot rows; `Soft`: a real
/// distribution; `Recording`: what a model was fed) are `kiln_core::testing`'s, shared with the
/// benchmark harness's tests.
const VOCAB: usize = Scripted::VOCAB;
const EOS: TokenId = TokenId(1);

/// Counts up from the last token, skipping EOS: 2, 3, ..., 31, 2, ...
fn count_up(token: u32, _position: u32) -> u32 {
    if token + 1 >= VOCAB as u32 {
        2
    } else {
        (token + 1).max(2)
    }
}

/// EOS once the position reaches 12.
fn eos_at_12(token: u32, position: u32) -> u32 {
    if position >= 11 {
        EOS.0
    } else {
        count_up(token, position)
    }
}

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 2,
    }
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    Request {
        prompt: prompt.iter().copied().map(TokenId).collect(),
        max_tokens,
        sampling: SamplingParams::greedy(),
        eos: vec![EOS],
        ..Request::default()
    }
}

fn paged(blocks: usize, page: usize) -> Box<dyn KvCache<B>> {
    let spec = CacheSpec {
        page_size: page,
        blocks: Some(blocks),
        ..CacheSpec::paged(4, 64)
    };
    spec.build::<B>(layout(), Dtype::F32, &Default::default())
        .unwrap()
}

/// A cache of `kind` for 4 sequences of 128 tokens, whose window (512) no test outgrows, taking
/// steps of up to `max_step` tokens.
fn of_kind(kind: CacheKind, max_step: usize) -> Box<dyn KvCache<B>> {
    let spec = CacheSpec {
        kind,
        window: 512,
        max_step,
        ..CacheSpec::paged(4, 128)
    };
    spec.build::<B>(layout(), Dtype::F32, &Default::default())
        .unwrap()
}

fn tokens(c: &Completion) -> Vec<u32> {
    c.tokens.iter().map(|t| t.0).collect()
}

/// What each request gives when it runs by itself.
fn alone(model: &Scripted, requests: &[Request]) -> Vec<Completion> {
    requests
        .iter()
        .map(|r| {
            let mut engine = Engine::new(model, paged(64, 4), EngineConfig::default()).unwrap();
            engine.submit(r.clone()).unwrap();
            engine.run(|_| {}).unwrap().remove(0)
        })
        .collect()
}

#[test]
fn length_and_eos_end_sequences_on_their_own() {
    let model = Scripted { script: eos_at_12 };
    let mut engine = Engine::new(&model, paged(64, 4), EngineConfig::default()).unwrap();
    engine.submit(request(&[5, 6, 7], 4)).unwrap();
    engine.submit(request(&[2; 10], 50)).unwrap();
    let done = engine.run(|_| {}).unwrap();
    assert_eq!(tokens(&done[0]), [8, 9, 10, 11]);
    assert_eq!(done[0].finish_reason, FinishReason::Length);
    // Positions 9, 10 produce tokens; position 11 produces EOS, which is not output.
    assert_eq!(tokens(&done[1]), [3, 4]);
    assert_eq!(done[1].finish_reason, FinishReason::Eos);
    assert!(engine.is_idle());
    assert_eq!(engine.cache().usage().used, 0);
}

#[test]
fn new_requests_are_admitted_mid_run_up_to_max_batch() {
    let model = Scripted { script: count_up };
    let config = EngineConfig {
        max_batch: 2,
        max_step_tokens: 64,

        ..EngineConfig::default()
    };
    let requests = vec![
        request(&[3, 4], 3),
        request(&[10, 11, 12], 8),
        request(&[20], 5),
        request(&[7, 7, 7, 7], 2),
    ];
    let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
    let mut done = Vec::new();
    for r in &requests[..3] {
        engine.submit(r.clone()).unwrap();
    }
    let mut steps = 0;
    while !engine.is_idle() {
        if steps == 2 {
            // Arrives while others run.
            engine.submit(requests[3].clone()).unwrap();
        }
        for event in engine.step().unwrap() {
            if let Event::Finished(c) = event {
                done.push(c);
            }
        }
        let (running, _) = engine.load();
        assert!(running <= 2, "step {steps}: {running} running");
        steps += 1;
    }
    done.sort_by_key(|c| c.id);
    let expected = alone(&model, &requests);
    for (ours, theirs) in done.iter().zip(&expected) {
        assert_eq!(tokens(ours), tokens(theirs));
    }
    assert_eq!(engine.cache().usage().used, 0);
}

/// Rows, not requests, fill the batch: one group's requests (a server's HTTP request with many
/// choices) hold at most `max_group_rows` rows, so a request of another group that arrives
/// later starts decoding at once instead of waiting for the whole group. Every request still
/// gets the tokens it gets alone.
#[test]
fn one_group_cannot_hold_every_row_of_the_batch() {
    let model = Scripted { script: count_up };
    let config = EngineConfig {
        max_batch: 4,
        max_step_tokens: 64,
        max_group_rows: Some(3),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
    let grouped = |prompt: &[u32], max_tokens, group| Request {
        group: Some(group),
        ..request(prompt, max_tokens)
    };
    let mut requests: Vec<Request> = (0..6).map(|i| grouped(&[2 + i], 12, 1)).collect();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut done = Vec::new();
    let collect = |events: Vec<Event>, done: &mut Vec<Completion>| {
        let mut tokens_of = HashMap::new();
        for event in events {
            match event {
                Event::Token { id, .. } => *tokens_of.entry(id.0).or_insert(0) += 1,
                Event::Finished(c) => done.push(c),
                Event::Text { .. } => {}
            }
        }
        tokens_of
    };
    collect(engine.step().unwrap(), &mut done);
    assert_eq!(engine.load(), (3, 3), "one row is kept from group 1");
    requests.push(grouped(&[20], 3, 2));
    let late = engine.submit(requests[6].clone()).unwrap();
    let first = collect(engine.step().unwrap(), &mut done);
    assert_eq!(
        first.get(&late.0),
        Some(&1),
        "the late request decodes at once"
    );
    assert_eq!(engine.load(), (4, 3));
    while !engine.is_idle() {
        collect(engine.step().unwrap(), &mut done);
        let (running, _) = engine.load();
        assert!(running <= 4);
    }
    done.sort_by_key(|c| c.id);
    for (ours, theirs) in done.iter().zip(&alone(&model, &requests)) {
        assert_eq!(tokens(ours), tokens(theirs));
    }
    assert_eq!(engine.cache().usage().used, 0);
}

/// A pool too small for every sequence's growth: the newest is preempted, recomputed later,
/// and still gives what it gives alone; no block leaks.
#[test]
fn running_out_of_blocks_preempts_instead_of_failing() {
    let model = Scripted { script: count_up };
    let requests: Vec<Request> = (0..4)
        .map(|i| request(&[2 + i, 3 + i, 4 + i, 5 + i], 12))
        .collect();
    // 4 sequences of up to 16 tokens need 16 blocks of 4; give 7.
    let mut engine = Engine::new(&model, paged(7, 4), EngineConfig::default()).unwrap();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let done = engine.run(|_| {}).unwrap();
    assert!(
        done.iter().any(|c| c.preemptions > 0),
        "no preemption happened"
    );
    for (ours, theirs) in done.iter().zip(&alone(&model, &requests)) {
        assert_eq!(tokens(ours), tokens(theirs));
        assert_eq!(ours.finish_reason, FinishReason::Length);
    }
    assert_eq!(engine.cache().usage().used, 0);
    // The same with a draft model drafting on a cache as small: preemption (which frees the
    // draft cache too) changes no token, a full draft cache only shortens drafts, and
    // nothing is left held in either cache.
    let drafting = EngineConfig {
        speculation: Some(Speculation {
            source: DraftSource::Model,
            draft_tokens: 3,
            adaptive: false,
            max_batch: 0,
        }),
        ..EngineConfig::default()
    };
    let draft = Scripted {
        script: count_up_mostly,
    };
    let mut engine = Engine::new(&model, paged(7, 4), drafting)
        .unwrap()
        .with_draft_model(&draft, paged(7, 4))
        .unwrap();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let done = engine.run(|_| {}).unwrap();
    assert!(done.iter().any(|c| c.preemptions > 0), "no preemption");
    assert!(engine.speculation_stats().accepted > 0);
    for (ours, theirs) in done.iter().zip(&alone(&model, &requests)) {
        assert_eq!(tokens(ours), tokens(theirs));
    }
    assert_eq!(engine.cache().usage().used, 0);
    assert_eq!(engine.draft_cache().unwrap().usage().used, 0);
}

/// Cancelling frees a running request's cache at once and drops a waiting one; the others
/// give what they give alone, and nothing more is reported for the cancelled ones.
#[test]
fn cancelled_requests_free_their_cache_at_once_and_the_rest_run_on() {
    let model = Scripted { script: count_up };
    let config = EngineConfig {
        max_batch: 2,
        ..EngineConfig::default()
    };
    let requests: Vec<Request> = (0..4)
        .map(|i| request(&[2 + i, 3 + i, 4 + i, 5 + i, 6 + i], 10))
        .collect();
    let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
    let ids: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let mut done = Vec::new();
    for _ in 0..3 {
        for event in engine.step().unwrap() {
            if let Event::Finished(c) = event {
                done.push(c);
            }
        }
    }
    assert_eq!(engine.load(), (2, 2));
    let before = engine.cache().usage().used;
    // Request 0 runs (its 5 prompt tokens and 2 generated ones: two blocks of 4), request 3 waits.
    assert!(engine.cancel(ids[0]));
    assert!(engine.cancel(ids[3]));
    assert_eq!(engine.load(), (1, 1));
    assert_eq!(engine.cache().usage().used, before - 8);
    assert!(!engine.cancel(ids[0]), "cancelled twice");
    let mut cancelled_events = 0;
    while !engine.is_idle() {
        for event in engine.step().unwrap() {
            match event {
                Event::Token { id, .. } | Event::Text { id, .. }
                    if id == ids[0] || id == ids[3] =>
                {
                    cancelled_events += 1
                }
                Event::Finished(c) => done.push(c),
                _ => {}
            }
        }
    }
    assert_eq!(cancelled_events, 0);
    let finished: Vec<_> = done.iter().map(|c| c.id).collect();
    assert_eq!(finished, [ids[1], ids[2]]);
    let expected = alone(&model, &requests);
    for c in &done {
        assert_eq!(tokens(c), tokens(&expected[c.id.0 as usize]));
    }
    assert!(
        !engine.cancel(ids[1]),
        "finished requests cannot be cancelled"
    );
    assert_eq!(engine.cache().usage().used, 0);
}

/// Prefill first: while any prompt is left, a step feeds whole prompts only (packed up to
/// `max_step_tokens`, a longer one alone in chunks) and every decode waits; then all sequences
/// decode together, one token each per step. The tokens are those each request gives alone.
#[test]
fn prefill_first_keeps_prompts_and_decodes_in_separate_steps() {
    let model = Scripted { script: count_up };
    let requests = vec![
        request(&[3, 4, 5], 5),
        request(&[10; 6], 5),
        request(&[20], 5),
        request(&[7; 4], 5),
        request(&[5; 10], 5),
    ];
    let config = EngineConfig {
        max_batch: 8,
        max_step_tokens: 8,
        policy: StepPolicy::PrefillFirst,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut steps: Vec<Vec<u64>> = Vec::new();
    let mut done = Vec::new();
    while !engine.is_idle() {
        let mut sampled = Vec::new();
        for event in engine.step().unwrap() {
            match event {
                Event::Token { id, .. } => sampled.push(id.0),
                Event::Finished(c) => done.push(c),
                Event::Text { .. } => {}
            }
        }
        sampled.sort_unstable();
        steps.push(sampled);
    }
    // 3 | 6 + 1 (4 does not fit in the 1 left) | 4 (10 does not fit) | 8 of 10 | the last 2;
    // then four decode steps for all five.
    let all = vec![0, 1, 2, 3, 4];
    let expected = [
        vec![0],
        vec![1, 2],
        vec![3],
        vec![],
        vec![4],
        all.clone(),
        all.clone(),
        all.clone(),
        all,
    ];
    assert_eq!(steps, expected);
    done.sort_by_key(|c| c.id);
    for (ours, theirs) in done.iter().zip(alone(&model, &requests)) {
        assert_eq!(tokens(ours), tokens(&theirs));
        assert_eq!(ours.finish_reason, FinishReason::Length);
    }
    assert_eq!(engine.cache().usage().used, 0);
}

/// Long prompts are prefilled in chunks of `max_step_tokens` and give the same output.
#[test]
fn chunked_prefill_gives_the_same_tokens() {
    let model = Scripted { script: count_up };
    let prompt: Vec<u32> = (0..50).map(|i| 2 + i % 29).collect();
    let requests = vec![request(&prompt, 6), request(&[9], 6)];
    let config = EngineConfig {
        max_batch: 4,
        max_step_tokens: 7,

        ..EngineConfig::default()
    };
    for kind in CacheKind::ALL {
        let cache = of_kind(kind, 7);
        let mut engine = Engine::new(&model, cache, config).unwrap();
        for r in &requests {
            engine.submit(r.clone()).unwrap();
        }
        let done = engine.run(|_| {}).unwrap();
        for (ours, theirs) in done.iter().zip(&alone(&model, &requests)) {
            assert_eq!(tokens(ours), tokens(theirs), "{kind}");
        }
        assert_eq!(engine.cache().usage().sequences, 0, "{kind}");
    }
}

/// Token 2 is "ab", 3 is "c#", 4 is "##d", 5 is "é" split over two tokens (5 and 6).
fn pieces(ids: &[TokenId]) -> Option<String> {
    let mut bytes = Vec::new();
    for t in ids {
        bytes.extend_from_slice(match t.0 {
            2 => b"ab".as_slice(),
            3 => b"c#",
            4 => b"##d",
            5 => &[0xC3],
            6 => &[0xA9],
            _ => b"x",
        });
    }
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn stream(engine: &mut Engine<'_, B>) -> (String, Vec<Completion>) {
    let mut streamed = String::new();
    let done = engine
        .run(|event| match event {
            Event::Token { text, .. } | Event::Text { text, .. } => streamed.push_str(text),
            Event::Finished(_) => {}
        })
        .unwrap();
    (streamed, done)
}

#[test]
fn stop_strings_across_token_boundaries_end_the_sequence_and_are_not_output() {
    let model = Scripted { script: count_up };
    let mut engine = Engine::new(&model, paged(64, 4), EngineConfig::default())
        .unwrap()
        .with_detokenizer(&pieces);
    // Generates 2 "ab", 3 "c#", 4 "##d": "abc###d" holds the stop "###" across 3 and 4.
    let mut r = request(&[31], 10);
    r.stop = vec!["###".into()];
    engine.submit(r).unwrap();
    let (streamed, done) = stream(&mut engine);
    assert_eq!(done[0].finish_reason, FinishReason::Stop);
    assert_eq!(done[0].text.as_deref(), Some("abc"));
    assert_eq!(streamed, "abc");
    assert_eq!(tokens(&done[0]), [2, 3, 4]);
}

#[test]
fn streamed_text_never_splits_a_character_and_ends_complete() {
    let model = Scripted { script: count_up };
    let mut engine = Engine::new(&model, paged(64, 4), EngineConfig::default())
        .unwrap()
        .with_detokenizer(&pieces);
    let mut r = request(&[4], 3);
    r.stop = vec!["é!".into()];
    engine.submit(r).unwrap();
    let mut events = Vec::new();
    let done = engine.run(|e| events.push(e.clone())).unwrap();
    let texts: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            Event::Token { text, .. } | Event::Text { text, .. } => Some(text.as_str()),
            Event::Finished(_) => None,
        })
        .collect();
    // Tokens 5, 6, 7: "é" is held back, first as half a character, then as a possible "é!".
    assert_eq!(texts, ["", "", "éx"]);
    assert_eq!(texts.concat(), "éx");
    assert!(texts.iter().all(|t| !t.contains('\u{FFFD}')));
    assert_eq!(done[0].text.as_deref(), Some("éx"));
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let model = Scripted { script: count_up };
    let mut engine = Engine::new(&model, paged(8, 4), EngineConfig::default()).unwrap();
    let cases = [
        (request(&[], 4), "empty"),
        (request(&vec![2; 1024], 4), "context"),
        (request(&[99], 4), "vocabulary"),
    ];
    for (r, needle) in cases {
        let err = engine.submit(r).unwrap_err();
        assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    }
    let mut r = request(&[2], 4);
    r.stop = vec!["x".into()];
    assert!(
        engine
            .submit(r)
            .unwrap_err()
            .to_string()
            .contains("tokenizer")
    );
    let mut r = request(&[2], 4);
    r.sampling.temperature = -1.0;
    assert!(engine.submit(r).is_err());
    assert!(engine.is_idle());
}

/// 32 requests sharing a 1,000-token system prompt, each with its own 8-token question,
/// submitted at once: the shared prompt is computed once (the others wait for its blocks
/// instead of computing it alongside), so the model is fed about 1,000 + 32 x (suffix) prompt
/// tokens, not 32 x 1,008; every answer equals its request alone; afterwards no block is held
/// and the prompt's blocks stay cached. With prefix caching off every prompt is computed whole.
#[test]
fn a_shared_system_prompt_is_computed_once() {
    let model = Scripted { script: count_up };
    let system: Vec<u32> = (0..1000).map(|i| 2 + (i * 7 % 29)).collect();
    let requests: Vec<Request> = (0..32u32)
        .map(|r| {
            let mut prompt = system.clone();
            prompt.extend((0..8).map(|i| 2 + (r * 3 + i * 5) % 29));
            request(&prompt, 4)
        })
        .collect();
    let (block, decode_fed) = (16, 32 * 3);
    let run = |prefix_cache: bool| {
        let counting = Recording::new(model);
        let config = EngineConfig {
            prefix_cache,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&counting, paged(600, block), config).unwrap();
        for r in &requests {
            engine.submit(r.clone()).unwrap();
        }
        let done = engine.run(|_| {}).unwrap();
        let stats = engine.prefix_stats();
        let usage = engine.cache().usage();
        (done, counting.tokens_fed(), stats, usage)
    };
    let (done, fed, stats, usage) = run(true);
    // 992 tokens (62 whole blocks) of the 1,008 are shared; each later request computes 16.
    let shared = 1000 / block * block;
    assert_eq!(fed, 1008 + 31 * (1008 - shared) + decode_fed);
    assert_eq!(stats.queried, 32 * 1008);
    assert_eq!(stats.hits, 31 * shared as u64);
    assert_eq!(done[0].cached_tokens, 0);
    assert!(done[1..].iter().all(|c| c.cached_tokens == shared));
    assert_eq!(
        (usage.used, usage.sequences),
        (0, 0),
        "a block is still held"
    );
    assert!(
        usage.cached >= shared,
        "the system prompt's blocks stay cached"
    );

    let (done_off, fed_off, stats_off, _) = run(false);
    assert_eq!(fed_off, 32 * 1008 + decode_fed);
    assert_eq!(stats_off.hits, 0);
    assert!(done_off.iter().all(|c| c.cached_tokens == 0));
    for (on, off) in done.iter().zip(&done_off) {
        assert_eq!(tokens(on), tokens(off));
    }
}

/// Prefix caching under pressure: a pool too small for every sequence, prompts sharing
/// blocks, preemption (the preempted sequence finds its own released blocks again) and a
/// cancellation; every answer equals its request alone and no block leaks.
#[test]
fn shared_blocks_survive_preemption_and_cancellation() {
    let model = Scripted { script: count_up };
    let common: Vec<u32> = (0..12).map(|i| 2 + i).collect();
    let requests: Vec<Request> = (0..5u32)
        .map(|r| {
            let mut prompt = common.clone();
            prompt.push(20 + r);
            request(&prompt, 10)
        })
        .collect();
    let mut engine = Engine::new(&model, paged(14, 4), EngineConfig::default()).unwrap();
    let ids: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let mut done = Vec::new();
    let mut steps = 0;
    while !engine.is_idle() {
        for event in engine.step().unwrap() {
            if let Event::Finished(c) = event {
                done.push(c);
            }
        }
        steps += 1;
        if steps == 4 {
            assert!(engine.cancel(ids[2]));
        }
    }
    done.sort_by_key(|c| c.id);
    assert!(done.iter().any(|c| c.preemptions > 0), "no preemption");
    assert!(
        done.iter().any(|c| c.cached_tokens > 0),
        "nothing was shared"
    );
    let expected = alone(&model, &requests);
    assert_eq!(done.len(), 4);
    for ours in &done {
        let i = ids.iter().position(|&id| id == ours.id).unwrap();
        assert_ne!(i, 2, "the cancelled request finished");
        assert_eq!(tokens(ours), tokens(&expected[i]), "request {i}");
    }
    let usage = engine.cache().usage();
    assert_eq!(
        (usage.used, usage.sequences),
        (0, 0),
        "a block is still held"
    );
}

/// A request that keeps its cache is continued by a later one, which computes only what the
/// kept tokens do not cover (rolling back where the prompts diverge), on every cache kind,
/// beside an unrelated request; the tokens are each request's alone; a cache can be continued
/// once; `stop` ends a waiting or running request with `Stop` (a stopped one keeps its cache);
/// a cancelled or released continuation frees it.
#[test]
fn kept_caches_are_continued_computing_only_what_is_new() {
    let model = Scripted { script: count_up };
    let keep = |prompt: &[u32], n: usize, continues: Option<kiln_engine::RequestId>| Request {
        keep_cache: true,
        continues,
        ..request(prompt, n)
    };
    let first_prompt: Vec<u32> = (0..20).map(|i| 2 + (i * 7) % 29).collect();
    for kind in CacheKind::ALL {
        let counting = Recording::new(model);
        let cache = of_kind(kind, 512);
        let mut engine = Engine::new(&counting, cache, EngineConfig::default()).unwrap();
        let run_fed = |engine: &mut Engine<'_, B>| {
            let before = counting.tokens_fed();
            let done = engine.run(|_| {}).unwrap();
            (done, counting.tokens_fed() - before)
        };

        let first = engine.submit(keep(&first_prompt, 5, None)).unwrap();
        let (done, fed) = run_fed(&mut engine);
        let generated: Vec<u32> = tokens(&done[0]);
        assert_eq!(fed, 20 + 4, "{kind}");
        // The last sampled token was never fed.
        let held: Vec<u32> = first_prompt
            .iter()
            .chain(&generated[..4])
            .copied()
            .collect();
        let as_ids = |v: &[u32]| v.iter().copied().map(TokenId).collect::<Vec<_>>();
        assert_eq!(
            engine.kept_tokens(first),
            Some(&as_ids(&held)[..]),
            "{kind}"
        );

        // Continue it with the whole conversation so far plus 6 new tokens, beside another.
        let mut second_prompt = first_prompt.clone();
        second_prompt.extend(&generated);
        second_prompt.extend([9, 8, 7, 6, 5, 4]);
        let second = engine.submit(keep(&second_prompt, 3, Some(first))).unwrap();
        engine.submit(request(&[3, 4, 5], 2)).unwrap();
        let (done, fed) = run_fed(&mut engine);
        assert_eq!(fed, (31 - 24) + 2 + 3 + 1, "{kind}: only the new tokens");
        assert_eq!(done[0].cached_tokens, 24, "{kind}");
        let plain = [request(&second_prompt, 3), request(&[3, 4, 5], 2)];
        for (ours, theirs) in done.iter().zip(&alone(&model, &plain)) {
            assert_eq!(tokens(ours), tokens(theirs), "{kind}");
        }
        assert_eq!(engine.kept_tokens(first), None, "continued once only");
        let again = engine.submit(keep(&second_prompt, 3, Some(first)));
        assert!(
            matches!(again, Err(EngineError::InvalidRequest(_))),
            "{kind}"
        );
        let unkept = engine.submit(keep(&second_prompt, 3, Some(done[1].id)));
        assert!(
            matches!(unkept, Err(EngineError::InvalidRequest(_))),
            "{kind}"
        );

        // Diverge inside the kept tokens: rolled back to the 10 shared ones.
        let mut third_prompt = first_prompt[..10].to_vec();
        third_prompt.extend([30, 29, 28]);
        let third = engine.submit(keep(&third_prompt, 4, Some(second))).unwrap();
        let (done, fed) = run_fed(&mut engine);
        assert_eq!((done[0].cached_tokens, fed), (10, 3 + 3), "{kind}");
        assert_eq!(
            tokens(&done[0]),
            tokens(&alone(&model, &[request(&third_prompt, 4)])[0])
        );
        assert_eq!(engine.cache().usage().sequences, 1, "{kind}");

        // Stop: a waiting request ends without tokens, a running one after its first token
        // and keeps its cache; a cancelled continuation frees it.
        let waiting = engine.submit(request(&[7, 7], 5)).unwrap();
        assert!(engine.stop(waiting));
        let events = engine.step().unwrap();
        let Some(Event::Finished(stopped)) = events.first() else {
            panic!("{kind}: {events:?}");
        };
        assert_eq!(
            (stopped.id, stopped.finish_reason),
            (waiting, FinishReason::Stop)
        );
        assert!(stopped.tokens.is_empty());
        let running = engine.submit(keep(&[4, 4, 4], 9, Some(third))).unwrap();
        let events = engine.step().unwrap();
        assert!(
            matches!(events[..], [Event::Token { .. }]),
            "{kind}: {events:?}"
        );
        assert!(engine.stop(running));
        let done = engine.run(|_| {}).unwrap();
        assert_eq!(
            (done[0].finish_reason, done[0].tokens.len()),
            (FinishReason::Stop, 1)
        );
        assert_eq!(
            engine.kept_tokens(running),
            Some(&as_ids(&[4, 4, 4])[..]),
            "{kind}"
        );
        let cancelled = engine
            .submit(keep(&[4, 4, 4, 5], 2, Some(running)))
            .unwrap();
        assert!(engine.cancel(cancelled));
        assert!(!engine.stop(cancelled));
        assert_eq!(
            engine.cache().usage().sequences,
            0,
            "{kind}: the cancel freed it"
        );
        assert!(!engine.release_kept(running));

        let last = engine.submit(keep(&[6, 6], 2, None)).unwrap();
        engine.run(|_| {}).unwrap();
        assert_eq!(engine.cache().usage().sequences, 1, "{kind}");
        assert!(engine.release_kept(last));
        assert_eq!(engine.cache().usage().sequences, 0, "{kind}");
    }
}

/// EOS after token 9; otherwise counts up.
fn eos_after_9(token: u32, position: u32) -> u32 {
    if token == 9 {
        EOS.0
    } else {
        count_up(token, position)
    }
}

/// Counts up like [`count_up`], but predicts 5 after 20 and after 8 (a draft model that is
/// usually right).
fn count_up_mostly(token: u32, position: u32) -> u32 {
    if token == 20 || token == 8 {
        5
    } else {
        count_up(token, position)
    }
}

/// Speculative decoding with prompt lookup and with a draft model gives every request exactly
/// its tokens, text and finish reason without speculation, on every cache kind: drafts
/// accepted in long runs (a prompt that already counts through the cycle), cut inside an
/// accepted run by a stop string, by `max_tokens`, and by an accepted EOS; drafts rejected (a
/// prompt whose repeats mislead the lookup, a draft model wrong now and then). Accepted runs
/// save forwards, rejected drafts are rolled back in both caches, and no cache space is left
/// held in either.
#[test]
fn speculation_changes_no_greedy_token() {
    // Every draft a lookup finds, always 5 of them; and the CLI's defaults (n-grams of 2 or
    // more, adaptive length).
    let eager = Speculation {
        source: DraftSource::PromptLookup {
            min_ngram: 1,
            max_ngram: 3,
        },
        draft_tokens: 5,
        adaptive: false,
        max_batch: 0,
    };
    let careful = Speculation {
        source: DraftSource::PromptLookup {
            min_ngram: 2,
            max_ngram: 3,
        },
        adaptive: true,
        ..eager
    };
    let drafted = Speculation {
        source: DraftSource::Model,
        draft_tokens: 4,
        adaptive: false,
        max_batch: 0,
    };
    let draft_model = Scripted {
        script: count_up_mostly,
    };
    let cycle = |n: u32| -> Vec<u32> { (0..n).map(|i| 2 + i % 30).collect() };
    let mut stopped = request(&cycle(58), 20);
    stopped.stop = vec!["###".into()];
    let counting = [
        stopped,
        request(&cycle(40), 23),
        // After 5 the lookup drafts 6 9 9 9 2; the model says 6 7: one draft stands.
        request(&[5, 6, 9, 9, 9, 2, 3, 4], 12),
        request(&[7], 9),
    ];
    let ending = [request(&[7, 8, 9, 1, 2, 3, 4, 5, 6], 10)];
    type Script = fn(u32, u32) -> u32;
    let cases: [(Script, &[Request]); 2] = [(count_up, &counting), (eos_after_9, &ending)];
    for (case, (script, requests)) in cases.into_iter().enumerate() {
        let model = Scripted { script };
        for kind in CacheKind::ALL {
            let run = |speculation: Option<Speculation>| {
                let cache = of_kind(kind, 64);
                let config = EngineConfig {
                    max_step_tokens: 64,
                    speculation,
                    ..EngineConfig::default()
                };
                let mut engine = Engine::new(&model, cache, config)
                    .unwrap()
                    .with_detokenizer(&pieces);
                if speculation.is_some_and(|s| s.source == DraftSource::Model) {
                    engine = engine
                        .with_draft_model(&draft_model, of_kind(kind, 64))
                        .unwrap();
                }
                for r in requests {
                    engine.submit(r.clone()).unwrap();
                }
                let (_, done) = stream(&mut engine);
                assert_eq!(engine.cache().usage().sequences, 0, "{kind}");
                if let Some(cache) = engine.draft_cache() {
                    assert_eq!(cache.usage().sequences, 0, "{kind}: draft cache");
                }
                (done, engine.speculation_stats())
            };
            let (plain, plain_stats) = run(None);
            for speculation in [eager, careful, drafted] {
                let (fast, stats) = run(Some(speculation));
                for (ours, theirs) in fast.iter().zip(&plain) {
                    assert_eq!(tokens(ours), tokens(theirs), "{kind}");
                    assert_eq!(ours.text, theirs.text, "{kind}");
                    assert_eq!(ours.finish_reason, theirs.finish_reason, "{kind}");
                    assert_eq!(theirs.speculation.drafted, 0);
                    let tokens_produced = theirs.speculation.tokens;
                    assert_eq!(ours.speculation.tokens, tokens_produced, "{kind}");
                }
                assert_eq!(
                    plain_stats.forwards, plain_stats.tokens,
                    "one token per forward"
                );
                assert!(stats.forwards < plain_stats.forwards, "{kind}: {stats:?}");
                if case == 0 {
                    assert_eq!(fast[0].finish_reason, FinishReason::Stop);
                    assert_eq!(fast[1].tokens.len(), 23);
                    let misled = fast[2].speculation;
                    if speculation != careful {
                        assert!(misled.drafted > misled.accepted, "{kind}: {misled:?}");
                    }
                    let copied = fast[1].speculation;
                    assert!(copied.tokens_per_forward() > 3.0, "{kind}: {copied:?}");
                } else {
                    assert_eq!(fast[0].finish_reason, FinishReason::Eos);
                    assert_eq!(tokens(&fast[0]), [7, 8, 9]);
                }
            }
        }
    }
}

/// A draft model is refused where it cannot work: without speculation by a draft model, with
/// another vocabulary, and a draft-model engine without one refuses requests.
#[test]
fn draft_models_are_checked() {
    let model = Scripted { script: count_up };
    let drafting = EngineConfig {
        speculation: Some(Speculation {
            source: DraftSource::Model,
            draft_tokens: 3,
            adaptive: true,
            max_batch: 0,
        }),
        ..EngineConfig::default()
    };
    let mut lone = Engine::new(&model, paged(8, 4), drafting).unwrap();
    let err = lone.submit(request(&[2], 4)).unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)), "{err}");
    let plain = Engine::new(&model, paged(8, 4), EngineConfig::default()).unwrap();
    assert!(plain.with_draft_model(&model, paged(8, 4)).is_err());
    let other = Soft {
        logit: |_, _, _| 0.0,
        vocab: 16,
    };
    let engine = Engine::new(&model, paged(8, 4), drafting).unwrap();
    let err = engine.with_draft_model(&other, paged(8, 4)).err().unwrap();
    assert!(err.to_string().contains("vocabulary"), "{err}");
}

/// The target of the distribution test: a few likely tokens that move with the context.
fn target_logit(token: u32, position: u32, v: u32) -> f32 {
    ((token * 7 + v * 5 + position * 3) % 11) as f32 * 0.35
}

/// A good draft: the target's preferences, slightly off.
fn close_logit(token: u32, position: u32, v: u32) -> f32 {
    target_logit(token, position, v) + ((v * 3 + token) % 4) as f32 * 0.15
}

/// A bad draft: the target's preferences scrambled (most of its likely tokens are still
/// proposed, with the wrong weights).
fn scrambled_logit(token: u32, position: u32, v: u32) -> f32 {
    target_logit(token, position, v) + ((v * 7 + token) % 5) as f32 * 0.8
}

/// Speculative sampling keeps the target's distribution: the first three generated tokens
/// (the first from the prompt's forward, the next two verified drafts) of many seeded requests
/// follow the target's exact joint distribution under temperature, top-k and top-p, whether
/// drafts come from prompt lookup (certain drafts), a close draft model or a scrambled one (a
/// chi-square test); the drafts' quality changes only how many are accepted. A plain engine
/// passes the same test, and an engine that accepted every draft would fail it.
#[test]
fn speculative_sampling_keeps_the_target_distribution() {
    use kiln_core::sampling::{Sampler, TokenHistory};
    const V: usize = 16;
    let target = Soft {
        logit: target_logit,
        vocab: V,
    };
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 4,
        top_p: 0.95,
        min_p: 0.0,
        ..SamplingParams::default()
    };
    // Repeats, so prompt lookup drafts often.
    let prompt = [3u32, 4, 5, 3, 4, 5, 3, 4];
    // The exact joint distribution of the first three tokens, from the target's rows.
    let sampler = Sampler::new(&sampling, V).unwrap();
    let next = |token: u32, position: u32| -> Vec<(u32, f64)> {
        let c = sampler
            .candidates(&target.row(token, position), &TokenHistory::default())
            .unwrap();
        let ids = c.ids().iter().map(|t| t.0);
        ids.zip(c.probabilities().into_iter().map(f64::from))
            .collect()
    };
    let last = prompt.len() as u32 - 1;
    let mut exact: HashMap<[u32; 3], f64> = HashMap::new();
    for (a, pa) in next(prompt[prompt.len() - 1], last) {
        for (b, pb) in next(a, last + 1) {
            for (c, pc) in next(b, last + 2) {
                exact.insert([a, b, c], pa * pb * pc);
            }
        }
    }
    let runs = 4000;
    let close = Soft {
        logit: close_logit,
        vocab: V,
    };
    let scrambled = Soft {
        logit: scrambled_logit,
        vocab: V,
    };
    let lookup = Speculation {
        source: DraftSource::PromptLookup {
            min_ngram: 1,
            max_ngram: 3,
        },
        draft_tokens: 2,
        adaptive: false,
        max_batch: 0,
    };
    let by_model = Speculation {
        source: DraftSource::Model,
        ..lookup
    };
    let cases: [(&str, Option<Speculation>, Option<&Soft>); 4] = [
        ("plain", None, None),
        ("prompt lookup", Some(lookup), None),
        ("close draft", Some(by_model), Some(&close)),
        ("scrambled draft", Some(by_model), Some(&scrambled)),
    ];
    let mut acceptance = HashMap::new();
    for (name, speculation, draft) in cases {
        let config = EngineConfig {
            max_batch: 16,
            speculation,
            ..EngineConfig::default()
        };
        let cache = || {
            let spec = CacheSpec {
                page_size: 4,
                ..CacheSpec::paged(16, 16)
            };
            spec.build::<B>(layout(), Dtype::F32, &Default::default())
                .unwrap()
        };
        let mut engine = Engine::new(&target, cache(), config).unwrap();
        if let Some(draft) = draft {
            engine = engine.with_draft_model(draft, cache()).unwrap();
        }
        for seed in 0..runs {
            // Four tokens, so the step after the first verifies two drafts.
            let mut r = request(&prompt, 4);
            r.eos.clear();
            r.sampling = SamplingParams {
                seed: Some(seed),
                ..sampling.clone()
            };
            engine.submit(r).unwrap();
        }
        let mut seen: HashMap<[u32; 3], f64> = HashMap::new();
        for c in engine.run(|_| {}).unwrap() {
            let t = tokens(&c);
            *seen.entry([t[0], t[1], t[2]]).or_default() += 1.0;
        }
        let (chi2, df) = chi_square(&seen, &exact, runs as f64);
        let bound = chi_square_quantile(df, 4.75);
        assert!(
            chi2 < bound,
            "{name}: chi-square {chi2:.1} over {df} degrees of freedom (bound {bound:.1})"
        );
        let stats = engine.speculation_stats();
        if speculation.is_some() {
            assert!(stats.drafted > 0, "{name}: {stats:?}");
        }
        acceptance.insert(name, stats.acceptance_rate());
    }
    assert!(
        acceptance["close draft"] > acceptance["scrambled draft"] + 0.2,
        "{acceptance:?}"
    );
}

/// Pearson's statistic of `seen` counts against `exact` probabilities over `n` samples, cells
/// expecting fewer than 5 pooled into one; and its degrees of freedom.
fn chi_square(
    seen: &HashMap<[u32; 3], f64>,
    exact: &HashMap<[u32; 3], f64>,
    n: f64,
) -> (f64, usize) {
    assert!(
        seen.keys().all(|k| exact.contains_key(k)),
        "a sequence the target cannot produce was sampled"
    );
    let (mut chi2, mut cells) = (0.0, 0);
    let (mut pooled_seen, mut pooled_expected) = (0.0, 0.0);
    for (key, &p) in exact {
        let expected = p * n;
        let observed = seen.get(key).copied().unwrap_or(0.0);
        if expected < 5.0 {
            pooled_seen += observed;
            pooled_expected += expected;
        } else {
            chi2 += (observed - expected).powi(2) / expected;
            cells += 1;
        }
    }
    if pooled_expected > 0.0 {
        chi2 += (pooled_seen - pooled_expected).powi(2) / pooled_expected.max(1.0);
        cells += 1;
    }
    (chi2, cells - 1)
}

/// The chi-square distribution's quantile `z` standard deviations up (Wilson-Hilferty);
/// z = 4.75 leaves a one-in-a-million chance of a false alarm.
fn chi_square_quantile(df: usize, z: f64) -> f64 {
    let k = df as f64;
    let h = 2.0 / (9.0 * k);
    k * (1.0 - h + z * h.sqrt()).powi(3)
}

/// A beam-search request on [`Soft`] (`target_logit`, 12 tokens, EOS 1).
fn beam_request(prompt: &[u32], max_tokens: usize, beam: BeamSearch) -> Request {
    Request {
        beam: Some(beam),
        ..request(prompt, max_tokens)
    }
}

fn soft_target() -> Soft {
    Soft {
        logit: target_logit,
        vocab: 12,
    }
}

/// `requests` through one engine on `cache` until all finish: their completions, in order,
/// after checking that each streamed exactly its tokens and that no cache is left held.
fn run_to_the_end(
    model: &dyn CausalLm<B>,
    cache: Box<dyn KvCache<B>>,
    requests: &[Request],
) -> Vec<Completion> {
    let mut engine = Engine::new(model, cache, EngineConfig::default()).unwrap();
    for r in requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut streamed: HashMap<u64, Vec<TokenId>> = HashMap::new();
    let done = engine
        .run(|e| {
            if let Event::Token { id, token, .. } = e {
                streamed.entry(id.0).or_default().push(*token);
            }
        })
        .unwrap();
    assert_eq!(engine.cache().usage().sequences, 0);
    for c in &done {
        assert_eq!(streamed.remove(&c.id.0).unwrap_or_default(), c.tokens);
    }
    done
}

/// Beam search runs through the scheduler like any request: on every cache kind, alone or
/// beside other requests, and when the scheduler preempts it (it starts over), it returns the
/// same hypotheses, streams the best one's tokens when it ends, and frees every beam's cache.
#[test]
fn beam_search_is_scheduled_like_any_request() {
    let model = soft_target();
    let beam = BeamSearch {
        num_beams: 3,
        length_penalty: 0.7,
        early_stopping: EarlyStopping::Never,
        num_return_sequences: 3,
    };
    let searched = beam_request(&[2, 5, 7, 3, 9], 12, beam);
    let mut plain = request(&[4, 4, 6, 2, 8, 10, 3, 5], 20);
    plain.eos.clear();
    let run = |cache, requests: &[Request]| run_to_the_end(&model, cache, requests);
    let expected = run(paged(64, 4), std::slice::from_ref(&searched)).remove(0);
    assert_eq!(expected.beams.len(), 3);
    assert!(expected.beams.windows(2).all(|w| w[0].score >= w[1].score));
    assert_eq!(expected.tokens, expected.beams[0].tokens);
    let greedy = run(paged(64, 4), &[plain.clone()]).remove(0);
    for kind in CacheKind::ALL {
        let alone = run(of_kind(kind, 512), std::slice::from_ref(&searched)).remove(0);
        assert_eq!(alone.beams, expected.beams, "{kind}");
        let both = run(of_kind(kind, 512), &[plain.clone(), searched.clone()]);
        assert_eq!(both[0].tokens, greedy.tokens, "{kind}");
        assert_eq!(both[1].beams, expected.beams, "{kind}");
    }
    // 12 blocks of 4: the search fits alone, and beside the plain request (7 blocks) only
    // part of the time: the newer one (the search) is preempted and starts over.
    let both = run(paged(12, 4), &[plain, searched]);
    assert!(both[1].preemptions > 0, "{:?}", both[1].preemptions);
    assert_eq!(both[0].tokens, greedy.tokens);
    assert_eq!(both[1].beams, expected.beams);
}

/// A beam search takes a row of the batch per beam: beside it, only the rows left run.
#[test]
fn a_beam_search_takes_a_row_per_beam() {
    let model = soft_target();
    let config = EngineConfig {
        max_batch: 4,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
    let searched = beam_request(&[2, 5, 7], 6, BeamSearch::new(3));
    let plain = request(&[4, 4, 6], 6);
    for r in [&searched, &plain, &plain] {
        engine.submit(r.clone()).unwrap();
    }
    engine.step().unwrap();
    assert_eq!(
        engine.load(),
        (2, 1),
        "3 beams and 1 plain request fill 4 rows"
    );
    engine.run(|_| {}).unwrap();
    assert_eq!(engine.cache().usage().used, 0);
}

#[test]
fn bad_beam_searches_are_refused_with_a_reason() {
    let model = soft_target();
    let mut engine = Engine::new(&model, paged(8, 4), EngineConfig::default()).unwrap();
    let two = BeamSearch::new(2);
    let mut cases = vec![
        (beam_request(&[2], 4, BeamSearch::new(0)), "num_beams"),
        (
            beam_request(
                &[2],
                4,
                BeamSearch {
                    num_return_sequences: 3,
                    ..two
                },
            ),
            "num_return_sequences",
        ),
        (
            beam_request(
                &[2],
                4,
                BeamSearch {
                    length_penalty: f32::INFINITY,
                    ..two
                },
            ),
            "length_penalty",
        ),
    ];
    let mut with_stop = beam_request(&[2], 4, two);
    with_stop.stop = vec!["x".into()];
    cases.push((with_stop, "stop strings"));
    let mut with_logprobs = beam_request(&[2], 4, two);
    with_logprobs.logprobs = Some(1);
    cases.push((with_logprobs, "log-probabilities"));
    let mut penalised = beam_request(&[2], 4, two);
    penalised.sampling.repetition_penalty = 1.2;
    cases.push((penalised, "penalties"));
    // More beams than the batch has rows (8 by default) could never run.
    cases.push((
        beam_request(&[2], 4, BeamSearch::new(9)),
        "rows of the batch",
    ));
    for (r, needle) in cases {
        let err = engine.submit(r).unwrap_err();
        assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    assert!(engine.is_idle());
    // A static cache of 4 rows cannot hold 5 beams.
    let mut engine = Engine::new(
        &model,
        of_kind(CacheKind::Static, 64),
        EngineConfig::default(),
    )
    .unwrap();
    let err = engine
        .submit(beam_request(&[2], 4, BeamSearch::new(5)))
        .unwrap_err();
    assert!(err.to_string().contains("holds 4"), "{err}");
    // A grouped request's beams must fit in the rows one group may hold.
    let config = EngineConfig {
        max_group_rows: Some(2),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, paged(8, 4), config).unwrap();
    let mut grouped = beam_request(&[2], 4, BeamSearch::new(3));
    grouped.group = Some(7);
    let err = engine.submit(grouped).unwrap_err();
    assert!(err.to_string().contains("kept for other requests"), "{err}");
}

/// `Speculation::max_batch`: while more sequences decode than it allows, nobody drafts; once
/// the batch shrinks, drafting resumes. The tokens are the same either way.
#[test]
fn speculation_waits_while_the_batch_is_larger_than_its_limit() {
    let model = Scripted { script: count_up };
    let cycle = |n: u32| -> Vec<TokenId> { (0..n).map(|i| TokenId(2 + i % 30)).collect() };
    let long = Request {
        prompt: cycle(40),
        ..request(&[], 24)
    };
    let short = Request {
        prompt: cycle(35),
        ..request(&[], 8)
    };
    let run = |max_batch: usize| {
        let speculation = Speculation {
            source: DraftSource::PromptLookup {
                min_ngram: 1,
                max_ngram: 3,
            },
            draft_tokens: 4,
            adaptive: false,
            max_batch,
        };
        let config = EngineConfig {
            speculation: Some(speculation),
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&model, paged(64, 4), config).unwrap();
        engine.submit(long.clone()).unwrap();
        engine.submit(short.clone()).unwrap();
        engine.run(|_| {}).unwrap()
    };
    let plain = alone(&model, &[long.clone(), short.clone()]);
    let limited = run(1);
    let unlimited = run(2);
    for done in [&limited, &unlimited] {
        assert_eq!(tokens(&done[0]), tokens(&plain[0]));
        assert_eq!(tokens(&done[1]), tokens(&plain[1]));
    }
    // The short request decodes only while the long one does: with a limit of 1, never drafts.
    assert_eq!(
        limited[1].speculation.drafted, 0,
        "{:?}",
        limited[1].speculation
    );
    assert!(unlimited[1].speculation.drafted > 0);
    // The long one drafts once it decodes alone.
    assert!(
        limited[0].speculation.accepted > 0,
        "{:?}",
        limited[0].speculation
    );
    assert!(limited[0].speculation.forwards > unlimited[0].speculation.forwards);
}

/// A grammar over `soft_target`'s 12 tokens: token `i` is the letter `a + i`, EOS is special.
fn letters_grammar(constraint: &OutputConstraint) -> Grammar {
    let vocab: Vec<TokenText> = (0..12u8)
        .map(|i| {
            if TokenId(u32::from(i)) == EOS {
                TokenText::Special("<eos>".into())
            } else {
                TokenText::Bytes(vec![b'a' + i])
            }
        })
        .collect();
    GrammarCompiler::new(&vocab, EOS)
        .unwrap()
        .compile(constraint)
        .unwrap()
}

/// Structured output runs through the scheduler like any request: on every cache kind, beside
/// another request, and preempted (its matcher survives, as its sampler does), it gives the
/// same tokens, all in the grammar's language, ended by EOS when the language says so.
#[test]
fn a_constrained_request_is_scheduled_like_any_request() {
    let model = soft_target();
    let grammar = letters_grammar(&OutputConstraint::Regex("[c-h]{16,24}".into()));
    let mut constrained = request(&[2, 5, 7, 3, 9], 30);
    constrained.constraint = Some(grammar.clone());
    let mut plain = request(&[4, 4, 6, 2, 8, 10, 3, 5], 20);
    plain.eos.clear();
    let run = |cache, requests: &[Request]| run_to_the_end(&model, cache, requests);
    let expected = run(paged(64, 4), std::slice::from_ref(&constrained)).remove(0);
    let text: String = expected
        .tokens
        .iter()
        .map(|t| char::from(b'a' + t.0 as u8))
        .collect();
    assert!((16..=24).contains(&text.len()), "{text}");
    assert!(text.chars().all(|c| ('c'..='h').contains(&c)), "{text}");
    // Unconstrained, the model writes other letters (so the mask did something).
    let free = run(paged(64, 4), &[request(&[2, 5, 7, 3, 9], 30)]).remove(0);
    assert_ne!(free.tokens, expected.tokens);
    let greedy = run(paged(64, 4), &[plain.clone()]).remove(0);
    for kind in CacheKind::ALL {
        let both = run(of_kind(kind, 512), &[plain.clone(), constrained.clone()]);
        assert_eq!(both[0].tokens, greedy.tokens, "{kind}");
        assert_eq!(both[1].tokens, expected.tokens, "{kind}");
        assert_eq!(both[1].finish_reason, expected.finish_reason, "{kind}");
    }
    // 10 blocks of 4 cannot hold both to the end (7 and 6 or more blocks): the newer one is
    // preempted and recomputed.
    let both = run(paged(10, 4), &[plain.clone(), constrained.clone()]);
    assert!(both.iter().any(|c| c.preemptions > 0), "no preemption");
    assert_eq!(both[0].tokens, greedy.tokens);
    assert_eq!(both[1].tokens, expected.tokens);

    // Refused by name: with beam search, and compiled for another vocabulary.
    let mut engine = Engine::new(&model, paged(8, 4), EngineConfig::default()).unwrap();
    let mut searched = beam_request(&[2], 4, BeamSearch::new(2));
    searched.constraint = Some(grammar);
    let err = engine.submit(searched).unwrap_err().to_string();
    assert!(err.contains("beam search does not take a grammar"), "{err}");
    let other = GrammarCompiler::new(&vec![TokenText::Bytes(b"a".to_vec()); 5], TokenId(0))
        .unwrap()
        .compile(&OutputConstraint::Regex("a".into()))
        .unwrap();
    let mut wrong = request(&[2], 4);
    wrong.constraint = Some(other);
    let err = engine.submit(wrong).unwrap_err().to_string();
    assert!(err.contains("vocabulary of 5 tokens"), "{err}");
}

/// A cache spec whose bytes overflow, or exceed any address space, is refused before anything
/// is allocated, naming its sizes; [`CacheSpec::bytes`] counts what each kind allocates.
#[test]
fn cache_specs_too_big_to_allocate_are_refused() {
    let layout = KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let per_token = layout.bytes_per_token(Dtype::F32) as u64;
    let paged = CacheSpec::paged(3, 40);
    // 3 sequences × 3 blocks of 16.
    assert_eq!(
        paged.bytes(layout, Dtype::F32),
        Some(3 * 3 * 16 * per_token)
    );
    let fixed = CacheSpec {
        kind: CacheKind::Static,
        ..paged
    };
    assert_eq!(fixed.bytes(layout, Dtype::F32), Some(3 * 40 * per_token));
    for spec in [
        CacheSpec {
            blocks: Some(usize::MAX),
            ..paged
        },
        CacheSpec {
            page_size: 1 << 60,
            ..paged
        },
        CacheSpec {
            max_sequences: usize::MAX,
            ..fixed
        },
    ] {
        let err = spec
            .build::<B>(layout, Dtype::F32, &Default::default())
            .err()
            .expect("refused");
        assert!(err.to_string().contains("does not fit in memory"), "{err}");
    }
}
