//! Everything inside the faces, for Kiln's own crates and tests (the CLI, the model zoo, the
//! Triton backend, the integration tests). Not a stable API: a user of the library reaches
//! for the root, `nn`, `engine` and `plugin`.

pub mod calibrate {
    pub use crate::calibrate::*;
}
pub mod codegen {
    pub use crate::codegen::*;
}
pub mod compare {
    pub use crate::compare::*;
}
pub mod cpu {
    pub use crate::cpu::*;
}
pub mod dot {
    pub use crate::dot::*;
}
pub mod graph {
    pub use crate::graph::*;
}
pub mod graph_file {
    pub use crate::graph_file::*;
}
pub mod host {
    pub use crate::host::*;
}
pub mod layerwise {
    pub use crate::layerwise::*;
}
pub mod module {
    pub use crate::module::*;
}
pub mod ops {
    pub use crate::ops::*;
}
pub mod passes {
    pub use crate::passes::*;
}
pub mod pnm {
    pub use crate::pnm::*;
}
pub mod pth {
    pub use crate::pth::*;
}
pub mod registry {
    pub use crate::registry::*;
}
pub mod seeded {
    pub use crate::seeded::*;
}
pub mod tensor {
    pub use crate::tensor::*;
}
pub mod var_builder {
    pub use crate::var_builder::*;
}
pub mod engine {
    pub use crate::engine::*;
    pub mod arena {
        pub use crate::engine::arena::*;
    }
    pub mod best {
        pub use crate::engine::best::*;
    }
    pub mod builder {
        pub use crate::engine::builder::*;
    }
    pub mod choices {
        pub use crate::engine::choices::*;
    }
    pub mod config {
        pub use crate::engine::config::*;
    }
    pub mod cudnn {
        pub use crate::engine::cudnn::*;
    }
    pub mod cudnn_graph {
        pub use crate::engine::cudnn_graph::*;
    }
    pub mod eight_bit {
        pub use crate::engine::eight_bit::*;
    }
    pub mod exec {
        pub use crate::engine::exec::*;
    }
    pub mod file {
        pub use crate::engine::file::*;
    }
    pub mod gemm {
        pub use crate::engine::gemm::*;
    }
    pub mod gpu {
        pub use crate::engine::gpu::*;
    }
    pub mod kernels {
        pub use crate::engine::kernels::*;
    }
    pub mod launch {
        pub use crate::engine::launch::*;
    }
    pub mod layer {
        pub use crate::engine::layer::*;
    }
    pub mod plan {
        pub use crate::engine::plan::*;
    }
    pub mod precision {
        pub use crate::engine::precision::*;
    }
    pub mod reformat {
        pub use crate::engine::reformat::*;
    }
    pub mod resolve {
        pub use crate::engine::resolve::*;
    }
    pub mod strided {
        pub use crate::engine::strided::*;
    }
    pub mod tactic {
        pub use crate::engine::tactic::*;
    }
}
