//! Newtypes for the integers that are easy to mix up: token ids, sequence ids, positions and
//! block ids.

use std::fmt;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[derive(serde::Serialize, serde::Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }
    };
}

id_newtype!(
    /// A token id in a model's vocabulary.
    TokenId(u32)
);
id_newtype!(
    /// Identifies one sequence (one request's prompt and continuation) across engine steps.
    SeqId(u64)
);
id_newtype!(
    /// A token's position in its own sequence, counted from 0; what RoPE and learned position
    /// embeddings see. Positions always come from the batch, never from a cache's length.
    Position(u32)
);
id_newtype!(
    /// One block (page) of the paged KV cache's pool.
    BlockId(u32)
);

impl Position {
    /// The position as an index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl BlockId {
    /// The block as an index into the pool.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a token of a vocabulary stands for, as constrained decoding needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenText {
    /// The bytes it adds to the text (byte-level BPE pieces decoded to raw bytes).
    Bytes(Vec<u8>),
    /// A special (control) token, by name: it stands for no text.
    Special(String),
}
