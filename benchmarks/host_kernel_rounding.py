"""Where the host kernel's float32 AdamW and optax's on this backend round differently.

  PYTHONPATH=. python3 benchmarks/host_kernel_rounding.py

One update of 1 Mi elements with configs/llama_1b.yaml's hyperparameters and
schedule (update 8, gradients clipped): optax.adamw jitted on the default
backend against the host kernel, counting the elements whose new weight, first
and second moment differ in any bit. Then checks the backend's own division,
square root and multiply-add against numpy's IEEE float32, and which order of
operations and fused multiply-adds reproduce the backend's moments and weights.
"""
import numpy as np, jax, jax.numpy as jnp, optax
from jaxoffload.config import load_config
from jaxoffload.train import learning_rate, adamw_args
from jaxoffload.host_adam import adamw_update

f32, f64 = np.float32, np.float64
cfg = load_config("configs/llama_1b.yaml", [])
sched, hyper = learning_rate(cfg), adamw_args(cfg)
b1, b2, eps, wd = (f32(hyper[k]) for k in ("b1", "b2", "eps", "weight_decay"))
clip_grad = cfg.optimizer.clip_grad
print("hyper", hyper, "clip", clip_grad, "backend", jax.default_backend())
N, COUNT = 1 << 20, 7  # COUNT updates already applied; this is update COUNT + 1.
rng = np.random.default_rng(0)
p = rng.standard_normal(N).astype(f32) * f32(0.02)
g = rng.standard_normal(N).astype(f32) * f32(0.01)
mu = rng.standard_normal(N).astype(f32) * f32(1e-3)
nu = (rng.standard_normal(N).astype(f32) * f32(1e-3)) ** 2

# Elementary ops: does the backend round like numpy?
x, y = rng.random(N).astype(f32) + f32(0.5), rng.random(N).astype(f32) + f32(0.5)
for name, fn, ref in [("div", lambda a, b: a / b, x / y), ("sqrt", lambda a, b: jnp.sqrt(a), np.sqrt(x)),
                      ("mul-add", lambda a, b: a * b + b, x * y + y)]:
  got = np.asarray(jax.jit(fn)(x, y))
  print(f"{name}: {int((got != ref).sum())} of {N} differ from numpy")

opt = optax.chain(optax.clip_by_global_norm(clip_grad), optax.adamw(sched, **hyper))
state = opt.init(jnp.asarray(p))
adam_state = state[1][0]._replace(count=jnp.asarray(COUNT, jnp.int32), mu=jnp.asarray(mu), nu=jnp.asarray(nu))
state = (state[0], (adam_state, state[1][1], state[1][2]._replace(count=jnp.asarray(COUNT, jnp.int32))))


@jax.jit
def step(p, g, state):
  u, state = opt.update(g, state, p)
  norm = optax.tree.norm(g)
  return optax.apply_updates(p, u), state, (norm, sched(state[1][2].count - 1))


new_p, new_state, (norm, lr_step) = step(jnp.asarray(p), jnp.asarray(g), state)
ref = [np.asarray(new_p), np.asarray(new_state[1][0].mu), np.asarray(new_state[1][0].nu)]
norm = f32(norm)
lr_jit = f32(jax.jit(sched)(jnp.asarray(COUNT, jnp.int32)))
lr_vmap = f32(np.asarray(jax.vmap(sched)(jnp.arange(COUNT, COUNT + 4)))[0])
lr_map = f32(np.asarray(jax.jit(lambda c: jax.lax.map(sched, c))(jnp.arange(COUNT, COUNT + 4)))[0])
print("lr in step", f32(lr_step).view(np.uint32), "lax.map", lr_map.view(np.uint32))
print("norm", norm, "clipping", norm >= clip_grad, "lr jit", lr_jit.view(np.uint32), "vmap", lr_vmap.view(np.uint32))
count = COUNT + 1
bias_dev = [f32(jax.jit(lambda c, b=b: 1 - b ** c)(jnp.asarray(count, jnp.int32))) for b in (hyper["b1"], hyper["b2"])]
bias_f64 = [f32(1 - hyper["b1"] ** count), f32(1 - hyper["b2"] ** count)]
print("bias device", [b.view(np.uint32) for b in bias_dev], "float64", [b.view(np.uint32) for b in bias_f64])


def report(name, got):
  print(f"{name:40s}", " ".join(f"{n}:{int((a != b).sum())}" for n, a, b in zip(("p", "mu", "nu"), got, ref)))


# The library's kernel as the trainer calls it.
pp, mm, vv = p.copy(), mu.copy(), nu.copy()
scale = f32(np.asarray(jnp.where(norm >= clip_grad, clip_grad / jnp.asarray(norm), 1.0)))
adamw_update(pp, g.copy(), mm, vv, learning_rate=float(lr_vmap), count=count, b1=hyper["b1"], b2=hyper["b2"],
             eps=hyper["eps"], weight_decay=hyper["weight_decay"], grad_scale=float(scale))
report("library kernel", (pp, mm, vv))


def fma(a, b, c):
  return (f64(a) * f64(b) + f64(c)).astype(f32)


# Given exactly matched moments, which form of the rest rounds as this backend does?
import itertools
c1, c2 = f32(1 - hyper["b1"]), f32(1 - hyper["b2"])
found = None
for clip_form in ("div", "recip"):
  if norm >= clip_grad:
    gg = (g / norm) * f32(clip_grad) if clip_form == "div" else (g * (f32(1) / norm)) * f32(clip_grad)
  else:
    gg = g
  m_forms = {"fma(c1,g,b1*mu)": fma(c1, gg, b1 * mu), "fma(b1,mu,c1*g)": fma(b1, mu, c1 * gg),
             "plain": c1 * gg + b1 * mu}
  v_forms = {"fma(c2,g2,b2*nu)": fma(c2, gg * gg, b2 * nu), "fma(b2,nu,c2*g2)": fma(b2, nu, c2 * (gg * gg)),
             "fma(c2*g,g,b2*nu)": fma(c2 * gg, gg, b2 * nu), "plain": c2 * (gg * gg) + b2 * nu}
  print("clip", clip_form, "m mismatches", {k: int((x != ref[1]).sum()) for k, x in m_forms.items()},
        "v mismatches", {k: int((x != ref[2]).sum()) for k, x in v_forms.items()})
  mf = [k for k, x in m_forms.items() if (x == ref[1]).all()]
  vf = [k for k, x in v_forms.items() if (x == ref[2]).all()]
  if mf and vf:
    found = m_forms[mf[0]], v_forms[vf[0]]
    print("moment forms that match:", clip_form, mf, vf)
if found:
  m, v = found
  lr = f32(lr_step)
  best = []
  for bias_name, bias in (("f64", bias_f64), ("device", bias_dev)):
    for mhat_form, u_form, new_form in itertools.product(
        ("div", "recip"), ("plain", "fma"), ("plain", "fma", "sub", "fma-neg")):
      mhat = m / bias[0] if mhat_form == "div" else m * (f32(1) / bias[0])
      nhat = v / bias[1] if mhat_form == "div" else v * (f32(1) / bias[1])
      den = np.sqrt(nhat) + eps
      direction = mhat / den
      u = direction + wd * p if u_form == "plain" else fma(wd, p, direction)
      if new_form == "plain":
        new = p + u * (-lr)
      elif new_form == "fma":
        new = fma(u, -lr, p)
      elif new_form == "sub":
        new = p - lr * u
      else:
        new = fma(-u, lr, p)
      best.append((int((new != ref[0]).sum()), bias_name, mhat_form, u_form, new_form))
  for row in sorted(best)[:6]:
    print("p mismatches", row)
