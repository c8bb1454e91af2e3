//! The configuration's JSON Schema (`outboxd config schema`) and the configuration reference made
//! from it. The schema is derived from the config structs by `schemars`, so it follows the structs:
//! their doc comments are its descriptions, their `serde` defaults its defaults, their enums its
//! allowed values. The reference is a walk over that schema, section by section, one row a key.

use serde_json::Value;

use crate::config::Config;

/// The sections in the order the reference lists them (the order of a config file): the ones an
/// environment override may address, which are all of them ([`sections`] fails on one missing).
const SECTIONS: [&str; 12] = crate::config::TOP_LEVEL;

/// The JSON Schema (draft 2020-12) of an outboxd config file.
pub fn schema() -> Value {
    let mut schema = schemars::schema_for!(Config).to_value();
    if let Some(object) = schema.as_object_mut() {
        object.insert("title".into(), "outboxd configuration".into());
        object.insert(
            "description".into(),
            "An outboxd config file (TOML): one source, one sink section, and the rest. Generated from the code by `outboxd config schema`.".into(),
        );
    }
    schema
}

/// One key of the reference.
struct Key {
    path: String,
    kind: String,
    default: Option<String>,
    required: bool,
    description: String,
    /// A table of any keys (`kafka.properties`, `route.headers`).
    free_form: bool,
}

/// Every key of every section as `(section, keys)`, in [`SECTIONS`] order. A key without a
/// description is listed with an empty one; [`undocumented`] names them.
fn sections(schema: &Value) -> Vec<(&'static str, String, Vec<Key>)> {
    let defs = schema.get("$defs").cloned().unwrap_or_default();
    let properties = schema["properties"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let required = required_of(schema);
    let mut out = Vec::new();
    for section in SECTIONS {
        let Some(property) = properties.get(section) else {
            panic!("the schema has no top-level key {section}: update reference::config::SECTIONS");
        };
        let resolved = resolve(property, &defs);
        let mut keys = Vec::new();
        let about;
        if resolved.get("properties").is_some() {
            about = description(property, &defs);
            collect(&resolved, &defs, "", &mut keys);
        } else {
            about = String::new();
            keys.push(key(
                section,
                property,
                &defs,
                required.contains(&section.to_string()),
            ));
        }
        out.push((section, about, keys));
    }
    let listed: Vec<&str> = SECTIONS.to_vec();
    for name in properties.keys() {
        assert!(
            listed.contains(&name.as_str()),
            "top-level key {name} is missing from reference::config::SECTIONS"
        );
    }
    out
}

/// The full paths (`source.tls.mode`; a top-level scalar by its own name) of the keys `wanted`
/// picks.
fn paths_where(wanted: impl Fn(&Key) -> bool + Copy) -> Vec<String> {
    let schema = schema();
    sections(&schema)
        .into_iter()
        .flat_map(|(section, _, keys)| {
            keys.into_iter().filter(wanted).map(move |k| {
                if k.path == section {
                    k.path
                } else {
                    format!("{section}.{}", k.path)
                }
            })
        })
        .collect()
}

/// The keys whose schema has no description (a config field without a doc comment).
pub fn undocumented() -> Vec<String> {
    paths_where(|k| k.description.is_empty())
}

/// Every key path a config may set (`source.tls.mode`, `route.additional[].column`,
/// `kafka.properties`), for checking the shipped example configs.
pub fn key_paths() -> Vec<String> {
    paths_where(|_| true)
}

/// The key paths that are tables of any keys (`kafka.properties`, `route.headers`): a config
/// may set any member of them.
pub fn free_form_paths() -> Vec<String> {
    paths_where(|k| k.free_form)
}

/// The full paths of the keys whose values are not text (numbers, booleans, lists, tables):
/// an environment override of one is read as a TOML literal.
pub fn typed_paths() -> Vec<String> {
    paths_where(|k| k.kind != "string" && !k.kind.starts_with("`\""))
}

fn required_of(schema: &Value) -> Vec<String> {
    schema["required"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Follows a `$ref` (also one inside an `anyOf` with `null`, as an `Option` is written).
fn resolve(schema: &Value, defs: &Value) -> Value {
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let name = reference.trim_start_matches("#/$defs/");
        return resolve(&defs[name], defs);
    }
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        let non_null: Vec<&Value> = any.iter().filter(|s| s["type"] != "null").collect();
        if non_null.len() == 1 {
            let mut inner = resolve(non_null[0], defs);
            if let (Some(object), Some(d)) = (inner.as_object_mut(), schema.get("description")) {
                object.insert("description".into(), d.clone());
            }
            return inner;
        }
    }
    schema.clone()
}

/// A property's own description, else its type's.
fn description(schema: &Value, defs: &Value) -> String {
    let own = schema.get("description").and_then(Value::as_str);
    let text = match own {
        Some(text) => text.to_string(),
        None => resolve(schema, defs)
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    };
    one_line(&text)
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn collect(object: &Value, defs: &Value, prefix: &str, keys: &mut Vec<Key>) {
    let required = required_of(object);
    let Some(properties) = object.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, property) in properties {
        let path = format!("{prefix}{name}");
        let resolved = resolve(property, defs);
        if resolved.get("properties").is_some() {
            keys.push(key(&path, property, defs, required.contains(name)));
            collect(&resolved, defs, &format!("{path}."), keys);
        } else if let Some(items) = array_of_objects(&resolved, defs) {
            keys.push(key(&path, property, defs, required.contains(name)));
            collect(&items, defs, &format!("{path}[]."), keys);
        } else {
            keys.push(key(&path, property, defs, required.contains(name)));
        }
    }
}

fn array_of_objects(schema: &Value, defs: &Value) -> Option<Value> {
    let items = resolve(schema.get("items")?, defs);
    items.get("properties").is_some().then_some(items)
}

fn key(path: &str, property: &Value, defs: &Value, required: bool) -> Key {
    let resolved = resolve(property, defs);
    let mut text = description(property, defs);
    let choices = choices(&resolved);
    let described: Vec<String> = choices
        .iter()
        .filter(|(_, d)| !d.is_empty())
        .map(|(v, d)| format!("`{v}`: {}", d.trim_end_matches('.')))
        .collect();
    if !described.is_empty() {
        if !text.is_empty() && !text.ends_with('.') {
            text.push('.');
        }
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&described.join("; "));
        text.push('.');
    }
    let free_form = resolved.get("properties").is_none()
        && resolved
            .get("additionalProperties")
            .is_some_and(Value::is_object);
    Key {
        free_form,
        path: path.to_string(),
        kind: kind(&resolved, &choices, defs),
        default: property
            .get("default")
            .filter(|d| !d.is_null())
            .map(literal),
        required,
        description: text,
    }
}

/// An enum's values with their descriptions (`oneOf` of `const`s, or a plain `enum`).
fn choices(schema: &Value) -> Vec<(String, String)> {
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .filter_map(|v| v.as_str().map(|s| (s.to_string(), String::new())))
            .collect();
    }
    let Some(one_of) = schema.get("oneOf").and_then(Value::as_array) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for variant in one_of {
        let d = one_line(
            variant
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default(),
        );
        if let Some(c) = variant.get("const").and_then(Value::as_str) {
            out.push((c.to_string(), d));
        } else if let Some(values) = variant.get("enum").and_then(Value::as_array) {
            for v in values.iter().filter_map(Value::as_str) {
                out.push((v.to_string(), d.clone()));
            }
        }
    }
    out
}

fn kind(schema: &Value, choices: &[(String, String)], defs: &Value) -> String {
    if !choices.is_empty() {
        return choices
            .iter()
            .map(|(v, _)| format!("`\"{v}\"`"))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let types: Vec<&str> = types.into_iter().filter(|t| *t != "null").collect();
    match types.as_slice() {
        ["array"] => {
            let items = schema
                .get("items")
                .map(|i| resolve(i, defs))
                .unwrap_or_default();
            if items.get("properties").is_some() {
                "array of tables".into()
            } else {
                format!("array of {}", kind(&items, &choices_of(&items), defs))
            }
        }
        ["object"] => match schema.get("additionalProperties").map(|a| resolve(a, defs)) {
            Some(values) if values.is_object() => {
                format!("table of {}", kind(&values, &choices_of(&values), defs))
            }
            _ => "table".into(),
        },
        ["integer"] => "integer".into(),
        [one] => (*one).to_string(),
        _ => "value".into(),
    }
}

fn choices_of(schema: &Value) -> Vec<(String, String)> {
    choices(schema)
}

/// A default as it is written in TOML.
fn literal(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(literal).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::Object(map) if map.is_empty() => "{}".into(),
        Value::Object(map) => {
            let inner: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{k} = {}", literal(v)))
                .collect();
            format!("{{ {} }}", inner.join(", "))
        }
        other => other.to_string(),
    }
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// `docs/reference/configuration.md`.
pub fn markdown() -> String {
    let schema = schema();
    let mut out = String::from(
        "<!-- Generated by `outboxd reference config` from the config structs: do not edit. Run scripts/gen-docs.sh. -->\n\
# Configuration reference\n\n\
Every key of an outboxd config file, with its type, default and meaning. A config is one TOML file \
(`--config PATH`, `OUTBOXD_CONFIG`, or `./outboxd.toml`); any key can also be set from the \
environment as `OUTBOXD_` + its path with `__` between levels (`OUTBOXD_KAFKA__BROKERS`, \
`OUTBOXD_SOURCE__PASSWORD`). Exactly one sink section (`[kafka]`, `[rabbitmq]`, `[nats]`, \
`[redis]`, `[sqs]` or `[sns]`) is set. How configuration works: \
[Configuration](../concepts/configuration.md).\n\n\
The same keys as a JSON Schema: [outboxd.schema.json](outboxd.schema.json). Editors that read \
JSON Schema can check a config with it. Take the schema of the outboxd you run (`outboxd config \
schema > outboxd.schema.json`: this page may be newer), and with Taplo (the TOML language server \
of VS Code's *Even Better TOML*) name it in the config's first line:\n\n\
```toml\n#:schema ./outboxd.schema.json\n```\n\n\
Keys marked required may also come from the environment (`OUTBOXD_NAME`, \
`OUTBOXD_SOURCE__URL`, …); an editor does not know that.\n",
    );
    for (section, about, keys) in sections(&schema) {
        if keys.len() == 1 && keys[0].path == section {
            out.push_str(&format!("\n## `{section}`\n\n"));
        } else {
            out.push_str(&format!("\n## `[{section}]`\n\n"));
            if !about.is_empty() {
                out.push_str(&format!("{about}\n\n"));
            }
        }
        out.push_str("| Key | Type | Default | Description |\n|---|---|---|---|\n");
        for k in keys {
            let default = match (&k.default, k.required) {
                (_, true) => "required".to_string(),
                (Some(d), false) => format!("`{}`", cell(d)),
                (None, false) => "unset".to_string(),
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                k.path,
                k.kind,
                default,
                cell(&k.description)
            ));
        }
    }
    out
}
