//! The module calls of a graph exported by `kiln-torch`: which module each node was traced in
//! (`Graph::modules` gives every module path's PyTorch class), and for each call of a module its
//! body as statements: calls of its child modules and ops written inline, over the values the call
//! reads and returns.

use crate::graph::{Graph, NodeId, Op};
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};

/// The class of a container that `forward` never calls itself (an `nn.ModuleList` iterated by its
/// parent): its path is only a prefix of its children's.
pub(super) const IMPLICIT_LIST: &str = "torch.nn.modules.container.ModuleList";

/// A value inside a body: argument `i` of the call, or output `j` of statement `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Val {
    Arg(usize),
    Out(usize, usize),
}

/// One statement of a body.
#[derive(Clone, Debug)]
pub(super) enum Stmt {
    /// A call of the child module `field` on `args`; `outs` are the nodes of its results.
    Call { field: String, child: Child, args: Vec<Val>, outs: Vec<NodeId> },
    /// One op written inline: node `node` on `args`, reading the weights `params`
    /// (`(field, name relative to the module, weight node)`).
    Op { node: NodeId, args: Vec<Val>, params: Vec<Param> },
}

/// A weight an inline op reads: the module's field for it, its name under the module's path,
/// and its node.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Param {
    pub field: String,
    pub name: String,
    pub node: NodeId,
}

#[derive(Clone, Debug)]
pub(super) enum Child {
    /// A Kiln layer (`Conv2d`, `ReLU`, ...): the one node of the call.
    Layer(NodeId),
    /// A module with a body of its own.
    Module(Box<Instance>),
}

/// One call of a module: its path and class, the nodes it reads (`args`) and returns (`rets`),
/// and its body.
#[derive(Clone, Debug)]
pub(super) struct Instance {
    pub path: String,
    pub class: String,
    pub args: Vec<NodeId>,
    pub rets: Vec<NodeId>,
    pub stmts: Vec<Stmt>,
}

/// The module tree of a graph.
pub(super) struct Tree<'g> {
    pub graph: &'g Graph,
    /// Module path → PyTorch class, with implicit containers added.
    pub classes: BTreeMap<String, String>,
    /// Paths of modules with children.
    parents: BTreeSet<String>,
    /// Per node: the module it was traced in (`None` for inputs and weights).
    owner: Vec<Option<String>>,
    readers: Vec<Vec<NodeId>>,
    outputs: BTreeSet<NodeId>,
}

/// The path of `path`'s parent module (`layer1.0` → `layer1`, `fc` → ``).
pub(super) fn parent(path: &str) -> &str {
    path.rfind('.').map_or("", |i| &path[..i])
}

/// The last segment of a path (`layer1.0.conv1` → `conv1`).
pub(super) fn last(path: &str) -> &str {
    path.rfind('.').map_or(path, |i| &path[i + 1..])
}

/// `name` relative to module `module` (`layer1.0.conv1.weight` under `layer1.0` → `conv1.weight`).
pub(super) fn relative<'a>(name: &'a str, module: &str) -> Option<&'a str> {
    if module.is_empty() {
        return Some(name);
    }
    name.strip_prefix(module).and_then(|r| r.strip_prefix('.'))
}

impl<'g> Tree<'g> {
    pub fn new(graph: &'g Graph) -> Result<Self> {
        if graph.modules.is_empty() {
            return Err(Error::Codegen {
                reason: "the graph records no module classes (`modules`): structured codegen needs a graph file from kiln-torch; \
                         use the flat mode for graphs traced in Rust"
                    .into(),
            });
        }
        let mut classes = graph.modules.clone();
        for path in graph.modules.keys() {
            let mut p = parent(path);
            while !p.is_empty() && !classes.contains_key(p) {
                classes.insert(p.to_string(), IMPLICIT_LIST.to_string());
                p = parent(p);
            }
        }
        classes.entry(String::new()).or_insert_with(|| "Model".into());
        let parents = classes.keys().filter(|p| !p.is_empty()).map(|p| parent(p).to_string()).collect();
        let owner = graph.nodes.iter().map(|n| (!n.op.is_leaf()).then(|| owner_of(&classes, &n.path))).collect();
        let outputs = graph.outputs.iter().map(|(_, id)| *id).collect();
        Ok(Self { graph, classes, parents, owner, readers: graph.readers(), outputs })
    }

    pub fn is_leaf(&self, path: &str) -> bool {
        !self.parents.contains(path)
    }

    /// The child of `module` whose subtree holds the module `owner`, if it is not `module`: a
    /// direct child, or an element of a list `forward` never calls whole (`cv2.1` of an
    /// `nn.ModuleList` indexed as `self.cv2[i](x)`), which the module then calls itself.
    fn child_toward<'a>(&self, module: &str, owner: &'a str) -> Option<&'a str> {
        if owner == module {
            return None;
        }
        let rest = if module.is_empty() { owner } else { &owner[module.len() + 1..] };
        let seg = rest.split('.').next().unwrap_or(rest);
        let child = &owner[..owner.len() - rest.len() + seg.len()];
        match self.classes.get(child).map(String::as_str) {
            Some(IMPLICIT_LIST) if child != owner => self.child_toward(child, owner),
            _ => Some(child),
        }
    }

    /// The model's call: every computing node, the graph's inputs in and outputs out.
    pub fn root(&self) -> Result<Instance> {
        let nodes: Vec<NodeId> = (0..self.graph.nodes.len()).filter(|&i| self.owner[i].is_some()).collect();
        let rets = self.graph.outputs.iter().map(|(_, id)| *id).collect();
        self.instance("", nodes, self.graph.inputs.clone(), rets)
    }

    /// The nodes of `nodes` read from outside `nodes` (weights left out), in order of first read,
    /// and those of `nodes` read outside them or by the graph's outputs.
    fn flow(&self, nodes: &[NodeId]) -> (Vec<NodeId>, Vec<NodeId>) {
        let inside: BTreeSet<NodeId> = nodes.iter().copied().collect();
        let mut args = Vec::new();
        for &n in nodes {
            for &i in &self.graph.nodes[n].inputs {
                if !inside.contains(&i) && !matches!(self.graph.nodes[i].op, Op::Weight { .. }) && !args.contains(&i) {
                    args.push(i);
                }
            }
        }
        let rets =
            nodes.iter().copied().filter(|&n| self.outputs.contains(&n) || self.readers[n].iter().any(|r| !inside.contains(r))).collect();
        (args, rets)
    }

    /// The body of one call of `path` made of `nodes` (in graph order).
    fn instance(&self, path: &str, nodes: Vec<NodeId>, args: Vec<NodeId>, rets: Vec<NodeId>) -> Result<Instance> {
        let class = self.classes.get(path).cloned().unwrap_or_default();
        let mut inst = Instance { path: path.to_string(), class, args, rets, stmts: Vec::new() };
        let mut vals: BTreeMap<NodeId, Val> = inst.args.iter().enumerate().map(|(i, &n)| (n, Val::Arg(i))).collect();
        for group in self.groups(path, &nodes) {
            let (args, outs) = match &group {
                Group::Inline(n) => (self.flow(&[*n]).0, vec![*n]),
                Group::Child(_, ns) => self.flow(ns),
            };
            let vargs = args
                .iter()
                .map(|a| {
                    vals.get(a).copied().ok_or_else(|| Error::Codegen {
                        reason: format!(
                            "`{}` reads %{a} ({}), which its module `{path}` neither receives nor makes",
                            self.node_path(*a),
                            a
                        ),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let k = inst.stmts.len();
            for (j, &o) in outs.iter().enumerate() {
                vals.insert(o, Val::Out(k, j));
            }
            inst.stmts.push(match group {
                Group::Inline(n) => Stmt::Op { node: n, args: vargs, params: self.params(path, n) },
                Group::Child(child, ns) => {
                    let field = relative(&child, path).unwrap_or(last(&child)).to_string();
                    let child = if self.is_leaf(&child) && self.is_layer_call(&child, &ns) {
                        Child::Layer(ns[0])
                    } else {
                        Child::Module(Box::new(self.instance(&child, ns, args, outs.clone())?))
                    };
                    Stmt::Call { field, child, args: vargs, outs }
                }
            });
        }
        if let Some(r) = inst.rets.iter().find(|r| !vals.contains_key(r)) {
            return Err(Error::Codegen { reason: format!("module `{path}` returns %{r}, which it does not make") });
        }
        Ok(inst)
    }

    fn node_path(&self, id: NodeId) -> &str {
        &self.graph.nodes[id].path
    }

    /// The weights node `n` reads, as fields of the module `module`.
    fn params(&self, module: &str, n: NodeId) -> Vec<Param> {
        let g = self.graph;
        g.nodes[n]
            .inputs
            .iter()
            .filter_map(|&i| match &g.nodes[i].op {
                Op::Weight { name, .. } => {
                    let rel = relative(name, module).unwrap_or(name);
                    Some(Param { field: super::ident(rel), name: rel.to_string(), node: i })
                }
                _ => None,
            })
            .collect()
    }

    /// `nodes` of module `path` grouped into statements: each inline op alone, each call of a
    /// child as the run of its nodes (a leaf child's run starts anew at each node named by its
    /// path: a module called twice in a row, as torchvision's reused `relu`).
    fn groups(&self, path: &str, nodes: &[NodeId]) -> Vec<Group> {
        let mut out: Vec<Group> = Vec::new();
        for &n in nodes {
            let owner = self.owner[n].as_deref().unwrap_or("");
            let Some(child) = self.child_toward(path, owner) else {
                out.push(Group::Inline(n));
                continue;
            };
            let primary = self.graph.nodes[n].path == child && self.is_leaf(child);
            match out.last_mut() {
                Some(Group::Child(c, ns)) if c == child && !(primary && ns.iter().any(|&m| self.graph.nodes[m].path == child)) => {
                    ns.push(n)
                }
                _ => out.push(Group::Child(child.to_string(), vec![n])),
            }
        }
        // A parameter-free leaf whose run is not one layer (`nn.Flatten`, torchvision's `Permute`)
        // is written inline.
        out.into_iter()
            .flat_map(|g| match g {
                Group::Child(c, ns) if self.is_leaf(&c) && !self.reads_weights(&ns) && !self.is_layer_call(&c, &ns) => {
                    ns.into_iter().map(Group::Inline).collect()
                }
                g => vec![g],
            })
            .collect()
    }

    fn reads_weights(&self, nodes: &[NodeId]) -> bool {
        nodes.iter().any(|&n| self.graph.nodes[n].inputs.iter().any(|&i| matches!(self.graph.nodes[i].op, Op::Weight { .. })))
    }

    fn is_layer_call(&self, child: &str, nodes: &[NodeId]) -> bool {
        nodes.len() == 1 && self.graph.nodes[nodes[0]].path == child && super::layers::layer(self.graph, nodes[0], child).is_some()
    }
}

enum Group {
    Inline(NodeId),
    Child(String, Vec<NodeId>),
}

/// The deepest module whose path is `path` or a prefix of it (by segments).
fn owner_of(classes: &BTreeMap<String, String>, path: &str) -> String {
    let mut p = path;
    loop {
        if classes.contains_key(p) {
            return p.to_string();
        }
        if p.is_empty() {
            return String::new();
        }
        p = parent(p);
    }
}
