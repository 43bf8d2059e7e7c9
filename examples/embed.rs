//! A minimal multi-threaded server of one engine file: the engine is loaded once, and several
//! worker threads each own an `ExecutionContext` (its stream, activation arena and CUDA graphs)
//! and answer requests from one queue. Needs a GPU.
//!
//! ```sh
//! cargo run --release -- build resnet50 --fp16 --max-batch 8 -o rn50.kiln
//! cargo run --release --example embed -- rn50.kiln --threads 4 --requests 256
//! ```
//!
//! An engine whose input is u8 frames (a model behind its GPU entry stage, `kiln build
//! mobilenet_v2 --frames 480x640 -o mnv2-frames.kiln`) is served the same way; its requests are
//! random byte levels.

use kiln::engine::{Engine, Gpu};
use kiln::HostTensor;
use std::error::Error;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Custom ops register themselves in the crate that defines them: naming a function of each
/// keeps kiln-models' entry stages and NMS linked in, so engine files that use them load here.
#[used]
static CUSTOM_OPS: [fn() -> Vec<String>; 3] = [
    kiln_models::classify_preset::classify_preset_entry_points,
    kiln_models::yolo_letterbox::letterbox_entry_points,
    kiln_models::yolo_nms::nms_entry_points,
];

/// One request: an input, and where its answer goes.
struct Request {
    input: HostTensor,
    reply: Sender<Answer>,
}

struct Answer {
    /// Each output's name and shape, and the worker that ran it.
    outputs: Vec<(String, Vec<usize>)>,
    worker: usize,
    latency: Duration,
}

/// A worker: one execution context, requests until the queue closes.
fn worker(id: usize, engine: Arc<Engine>, queue: Arc<Mutex<Receiver<Request>>>) -> kiln::Result<usize> {
    let mut ctx = engine.context()?;
    let input_name = engine.inputs()[0].0.to_string();
    let mut served = 0;
    loop {
        // The lock is held only to take one request, not while running it.
        let next = queue.lock().expect("queue").recv();
        let Ok(request) = next else { return Ok(served) };
        let t = Instant::now();
        let out = ctx.run(&[(input_name.as_str(), &request.input)])?;
        let outputs = out.into_iter().map(|(name, t)| (name, t.shape)).collect();
        let _ = request.reply.send(Answer { outputs, worker: id, latency: t.elapsed() });
        served += 1;
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let usage = "usage: embed ENGINE.kiln [--threads 4] [--requests 64]";
    let (mut path, mut threads, mut requests) = (None, 4usize, 64usize);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--threads" => threads = it.next().ok_or(usage)?.parse()?,
            "--requests" => requests = it.next().ok_or(usage)?.parse()?,
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            _ if a.starts_with('-') || path.is_some() => return Err(format!("unexpected `{a}`; {usage}").into()),
            _ => path = Some(a),
        }
    }
    let path = path.ok_or(usage)?;
    kiln::engine::gpu_available().map_err(|reason| format!("embed serves a GPU engine; no GPU here ({reason})"))?;
    let gpu = Gpu::new(0)?;
    let engine = Arc::new(Engine::load(&path, &gpu)?);
    let (name, dims) = engine.inputs()[0];
    let shape: Vec<usize> = std::iter::once(engine.config.min_batch).chain(dims.iter().copied()).collect();
    println!("{path}: input `{name}` {shape:?}, {threads} worker threads, {requests} requests");

    let (send, queue) = channel::<Request>();
    let queue = Arc::new(Mutex::new(queue));
    let workers: Vec<_> = (0..threads.max(1))
        .map(|id| {
            let (engine, queue) = (Arc::clone(&engine), Arc::clone(&queue));
            std::thread::spawn(move || worker(id, engine, queue))
        })
        .collect();
    let t = Instant::now();
    let (reply, answers) = channel();
    let bytes = engine.input_dtype(name) == Some(kiln::DType::U8);
    for r in 0..requests {
        let input = request_input(&shape, r, bytes);
        send.send(Request { input, reply: reply.clone() })?;
    }
    drop((send, reply));
    let answers: Vec<Answer> = answers.iter().collect();
    for w in workers {
        w.join().map_err(|_| "a worker panicked")??;
    }
    let wall = t.elapsed().as_secs_f64();
    let mut per_worker = vec![0usize; threads.max(1)];
    answers.iter().for_each(|a| per_worker[a.worker] += 1);
    let mut latencies: Vec<f64> = answers.iter().map(|a| a.latency.as_secs_f64() * 1e3).collect();
    latencies.sort_by(f64::total_cmp);
    let median = latencies.get(latencies.len() / 2).copied().unwrap_or(0.0);
    if let Some(first) = answers.first() {
        println!("outputs: {:?}", first.outputs);
    }
    println!(
        "served {} requests in {wall:.3} s ({:.1}/s); per worker {per_worker:?}; median {median:.3} ms",
        answers.len(),
        answers.len() as f64 / wall
    );
    Ok(())
}

/// A stand-in for request `r`'s payload: values spread over [-1, 1) that differ per request (pixel
/// levels 0..=255 for an input declared u8), so that each answer is checked against its own input.
fn request_input(shape: &[usize], r: usize, bytes: bool) -> kiln::HostTensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| {
            let v = ((i.wrapping_mul(2_654_435_761) ^ r.wrapping_mul(40_503)) % 2048) as f32 / 1024.0 - 1.0;
            if bytes {
                ((v + 1.0) * 127.9).floor()
            } else {
                v
            }
        })
        .collect();
    kiln::HostTensor::new(shape.to_vec(), data)
}
