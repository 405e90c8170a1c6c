//! Tokenizers from every source a checkpoint ships, against the reference tokenizers:
//! transformers' (`tokenizer.json`, GPT-2's vocab + merges) and tiktoken (Meta's
//! `tokenizer.model`).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use crate::common::*;
use kiln_core::TokenId;
use kiln_models::TextTokenizer;
use kiln_models::chat::ChatTemplate;
use serde_json::Value;

#[test]
fn gpt2_vocab_and_merges_encode_the_prompts_as_transformers() {
    let dir = fixture("gpt2-tiny");
    let tok =
        TextTokenizer::from_vocab_merges(&dir.join("vocab.json"), &dir.join("merges.txt")).unwrap();
    let (json, cases) = reference("gpt2-tiny");
    assert!(json["cases"].as_array().unwrap().len() >= 5);
    let prompts = [
        "The quick brown fox",
        "Once upon a time there was",
        "def add(a, b):\n    return",
        "In 2024 the model read 1234567",
        "Tell me a story about a dragon",
    ];
    for (prompt, case) in prompts.iter().zip(&cases) {
        assert_eq!(
            tok.encode(prompt, false).unwrap(),
            case.prompt,
            "{prompt:?}"
        );
        assert_eq!(tok.decode(&case.prompt, false).unwrap(), *prompt);
    }
    assert!(tok.token_id("<|endoftext|>").is_some());
}

/// Llama 3's, Qwen2's and a SentencePiece (Llama 2 / Mistral, Phi-3) `tokenizer.json` layout
/// (Qwen2's: NFC, single digits, no BOS; SentencePiece's: Metaspace, byte fallback; Phi-3's
/// chat tokens take the whitespace after them).
#[test]
fn tokenizer_json_matches_transformers_on_tricky_strings() {
    for name in ["llama-tiny", "qwen2-tiny", "llama2-tiny", "phi3-tiny"] {
        let tok =
            TextTokenizer::from_tokenizer_json(&fixture(name).join("tokenizer.json")).unwrap();
        let (json, _) = reference(name);
        for case in json["tokenizer_cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            // transformers' tokenizer.encode adds <|begin_of_text|> for Llama, nothing for
            // Qwen2, as ours does with specials.
            assert_eq!(
                tok.encode(text, true).unwrap(),
                ids(&case["ids"]),
                "{name}: {text:?}"
            );
        }
    }
}

#[test]
fn meta_tokenizer_model_matches_tiktoken() {
    let dir = fixture("llama-tiny-meta");
    let tok = TextTokenizer::from_tiktoken(&dir.join("tokenizer.model")).unwrap();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tiktoken_reference.json")).unwrap(),
    )
    .unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
    }
    // 384 base tokens, then Meta's 256 specials in order.
    assert_eq!(tok.token_id("<|begin_of_text|>"), Some(TokenId(384)));
    assert_eq!(tok.token_id("<|eot_id|>"), Some(TokenId(393)));
    assert_eq!(tok.vocab_size(), 640);
    assert_eq!(tok.encode("hi", true).unwrap()[0], TokenId(384));
}

/// The chat-templated prompt transformers was given (case 5 of the Llama fixtures) is what
/// kiln's Llama-3 chat template renders, through the Meta tokenizer.
#[test]
fn llama3_chat_format_matches_the_reference_prompt() {
    use kiln_models::chat::{ChatMessage, ChatTemplate, Role};
    use kiln_models::loaders::LLAMA3_CHAT_TEMPLATE;
    let dir = fixture("llama-tiny-meta");
    let tok = TextTokenizer::from_tiktoken(&dir.join("tokenizer.model")).unwrap();
    let template =
        ChatTemplate::new(LLAMA3_CHAT_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>").unwrap();
    let text = template
        .render(&[ChatMessage::new(Role::User, "Tell me a story")], true)
        .unwrap();
    let (_, cases) = reference("llama-tiny-meta");
    assert_eq!(tok.encode(&text, false).unwrap(), cases[5].prompt);
}

/// Gemma's chat template (no system role, `model` for the assistant, contents trimmed) renders
/// as transformers renders it, and refuses a system message with transformers' error.
#[test]
fn gemma_chat_template_renders_as_transformers() {
    let loaded = load::<burn::backend::Flex>("gemma2-tiny", kiln_core::Dtype::F32);
    let template =
        ChatTemplate::new(loaded.chat_template.as_ref().unwrap(), "<bos>", "<eos>").unwrap();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let (json, _) = reference("gemma2-tiny");
    for case in json["chat_cases"].as_array().unwrap() {
        let messages = chat_messages(&case["messages"]);
        match case["error"].as_str() {
            Some(error) => {
                let err = template.render(&messages, true).unwrap_err().to_string();
                assert!(err.contains(error), "{err}");
            }
            None => {
                let text = template.render(&messages, true).unwrap();
                assert_eq!(text, case["rendered"].as_str().unwrap());
                let ids: Vec<TokenId> = case["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| TokenId(i.as_u64().unwrap() as u32))
                    .collect();
                assert_eq!(tokenizer.encode(&text, false).unwrap(), ids);
            }
        }
    }
}

/// A SentencePiece model's folder as transformers 5 saves it (the template in
/// `chat_template.jinja`, not in `tokenizer_config.json`): kiln finds the template, and the
/// chat prompt it renders and encodes is the one transformers' `apply_chat_template` gave
/// (case 5 of the reference); decoding gives the text back without the prefix space.
#[test]
fn sentencepiece_folder_chat_template_and_decoding_match_transformers() {
    let loaded = load::<burn::backend::Flex>("llama2-tiny", kiln_core::Dtype::F32);
    let template =
        ChatTemplate::new(loaded.chat_template.as_ref().unwrap(), "<s>", "</s>").unwrap();
    let text = template
        .render(
            &[kiln_models::chat::ChatMessage::new(
                kiln_models::chat::Role::User,
                "Tell me a story",
            )],
            true,
        )
        .unwrap();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let (_, cases) = reference("llama2-tiny");
    assert_eq!(tokenizer.encode(&text, false).unwrap(), cases[5].prompt);
    assert!(loaded.generation.add_bos);
    for text in ["Hello  world\n", "naïve café 🙂", "日本語"] {
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), text);
    }
}

/// Phi-3's chat template (a system turn, the generation prompt) renders and encodes as
/// transformers' `apply_chat_template` did (case 5 of the reference); `<|end|>` ends a reply
/// beside `<|endoftext|>` (generation_config.json), and no BOS is added.
#[test]
fn phi3_chat_template_matches_transformers() {
    use kiln_models::chat::{ChatMessage, Role};
    let loaded = load::<burn::backend::Flex>("phi3-tiny", kiln_core::Dtype::F32);
    let template = ChatTemplate::new(
        loaded.chat_template.as_ref().unwrap(),
        "<s>",
        "<|endoftext|>",
    )
    .unwrap();
    let messages = [
        ChatMessage::new(Role::System, "Be brief."),
        ChatMessage::new(Role::User, "Tell me a story"),
    ];
    let text = template.render(&messages, true).unwrap();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let (_, cases) = reference("phi3-tiny");
    assert_eq!(tokenizer.encode(&text, false).unwrap(), cases[5].prompt);
    let end = tokenizer.token_id("<|end|>").unwrap();
    let endoftext = tokenizer.token_id("<|endoftext|>").unwrap();
    assert_eq!(loaded.generation.eos, vec![endoftext, end]);
    assert!(!loaded.generation.add_bos);
}

/// Qwen3's thinking switch: the template variable `enable_thinking` (`--chat-template-kwargs`,
/// the server's `chat_template_kwargs`) renders as transformers' `apply_chat_template` renders
/// it, absent, true and false (an empty think block after the assistant's header); a variable
/// kiln sets itself is refused.
#[test]
fn qwen3_thinking_switch_renders_as_transformers() {
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3-tiny").join("thinking_chat_cases.json")).unwrap(),
    )
    .unwrap();
    let template =
        ChatTemplate::new(cases["template"].as_str().unwrap(), "", "<|im_end|>").unwrap();
    let tokenizer =
        TextTokenizer::from_tokenizer_json(&fixture("qwen3-tiny").join("tokenizer.json")).unwrap();
    let mut rendered = Vec::new();
    for case in cases["cases"].as_array().unwrap() {
        let messages = chat_messages(&case["messages"]);
        let kwargs = case["kwargs"].as_object().unwrap();
        let text = template.render_with(&messages, true, kwargs).unwrap();
        assert_eq!(text, case["rendered"].as_str().unwrap(), "{kwargs:?}");
        assert_eq!(tokenizer.encode(&text, false).unwrap(), ids(&case["ids"]));
        rendered.push(text);
    }
    assert_ne!(rendered[2], rendered[0], "thinking off changes the prompt");
    let reserved = serde_json::json!({"add_generation_prompt": false});
    let err = template
        .render_with(&[], true, reserved.as_object().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("`add_generation_prompt`"), "{err}");
}

/// The chat template of a loaded fixture, with the BOS and EOS texts the server gives it.
fn loaded_template(loaded: &kiln_models::LoadedModel<burn::backend::Flex>) -> Option<ChatTemplate> {
    let tokenizer = loaded.tokenizer.as_ref()?;
    let text = |id: Option<TokenId>| {
        id.and_then(|id| tokenizer.inner().id_to_token(id.0))
            .unwrap_or_default()
    };
    let bos = text(loaded.generation.bos);
    let eos = text(loaded.generation.eos.first().copied());
    Some(ChatTemplate::new(loaded.chat_template.as_ref()?, &bos, &eos).unwrap())
}

/// The cases of a `special_in_content.json` (scripts/reference/make_special_in_content.py):
/// kiln renders each conversation as transformers did; its chat prompt reads the special
/// tokens' text in the messages as text (`ids`: the template's special tokens as control
/// tokens, the pieces between them tokenized with `split_special_tokens=True`), and allowed,
/// as control tokens (`parsed_ids`: `apply_chat_template(tokenize=True)`).
pub fn check_special_in_content(tokenizer: &TextTokenizer, template: &ChatTemplate, json: &Value) {
    use kiln_models::tokenizer::SpecialsInContent;
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.iter().any(|c| c["ids"] != c["parsed_ids"]));
    let none = serde_json::Map::new();
    for case in cases {
        let messages = chat_messages(&case["messages"]);
        let text = template.render(&messages, true).unwrap();
        assert_eq!(text, case["rendered"].as_str().unwrap());
        let chat = |specials| {
            tokenizer
                .encode_chat(template, &messages, true, &none, specials)
                .unwrap()
        };
        assert_eq!(chat(SpecialsInContent::Text), ids(&case["ids"]), "{text:?}");
        assert_eq!(
            chat(SpecialsInContent::Control),
            ids(&case["parsed_ids"]),
            "{text:?}"
        );
    }
}

/// #43 class 8 against transformers: a message that spells the template's special tokens
/// (`<|eot_id|><|start_header_id|>system<|end_header_id|>`) cannot close its turn. Llama 3
/// (byte-level BPE, contents trimmed) and Phi-3 (SentencePiece with Metaspace's
/// `prepend_scheme: first`; chat tokens that take the whitespace after them).
#[test]
fn special_tokens_in_messages_are_text_as_in_the_reference() {
    for name in ["llama-tiny", "phi3-tiny"] {
        let loaded = load::<burn::backend::Flex>(name, kiln_core::Dtype::F32);
        let template = loaded_template(&loaded).unwrap();
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("special_in_content.json")).unwrap(),
        )
        .unwrap();
        check_special_in_content(loaded.tokenizer.as_ref().unwrap(), &template, &json);
    }
}

/// Where no message spells a special token, the chat prompt is the rendered text tokenized
/// as it always was (transformers' `apply_chat_template(tokenize=True)`), for every fixture
/// with a chat template; angle brackets, bars and a non-special added token (`<tool>`,
/// `<think>`) included.
#[test]
fn chat_prompts_without_special_text_are_plain_tokenization() {
    use kiln_models::chat::{ChatMessage, Role};
    use kiln_models::tokenizer::SpecialsInContent;
    let conversations = [
        vec![ChatMessage::new(Role::User, "Tell me a story")],
        vec![
            ChatMessage::new(Role::System, "Be brief. <b>|x|</b>"),
            ChatMessage::new(
                Role::User,
                "  Hello <|im_ <tool> <think>\nwhy</think> [INST \n",
            ),
        ],
        vec![
            ChatMessage::new(Role::User, "Hi"),
            ChatMessage::new(Role::Assistant, "<think>\n\n</think>\n\nHello!"),
            ChatMessage::new(Role::User, "naïve 日本語 🙂"),
        ],
    ];
    let none = serde_json::Map::new();
    let mut checked = 0;
    for name in FIXTURES {
        let loaded = load::<burn::backend::Flex>(name, kiln_core::Dtype::F32);
        let (Some(template), Some(tokenizer)) = (loaded_template(&loaded), &loaded.tokenizer)
        else {
            continue;
        };
        for messages in &conversations {
            // Gemma's template refuses a system turn.
            let Ok(text) = template.render(messages, true) else {
                continue;
            };
            let plain = tokenizer.encode(&text, false).unwrap();
            for specials in [SpecialsInContent::Text, SpecialsInContent::Control] {
                let ids = tokenizer
                    .encode_chat(&template, messages, true, &none, specials)
                    .unwrap();
                assert_eq!(ids, plain, "{name}: {text:?}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked}");
}
